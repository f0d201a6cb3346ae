"""Block sizes, warps and stages for the Pallas (Triton-lowered) kernels, keyed by GPU architecture.

Architectures: ``sm90`` (H100/H200, 227 KiB shared memory per block), ``gfx942`` (MI300X, 64 KiB LDS,
wave64), ``gfx950`` (MI355X, 160 KiB LDS, wave64) and ``fallback`` (conservative, any GPU).
``python -m benchmarks autotune`` sweeps the search space of ``kernels/registry.py`` on a GPU and prints an entry for
these tables (``kernels/tooling/sweep.py``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax


@dataclasses.dataclass(frozen=True)
class Launch:
    """Triton launch parameters of one kernel."""

    num_warps: int = 4
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Chunk length, tiles, launch parameters and launch forms of the recurrent kernels (``kernels/recurrent/``).

    ``K``, ``V`` in the rules below are the padded head dims (powers of two >= 16). The evidence for each table
    entry is in ``benchmarks/NOTES.md`` (the section named beside the entry)."""

    chunk: int = 64
    """Rows per chunk when the caller passes ``chunk_size=None`` (a power of two >= 16)."""
    block_v: int = 32
    """V tile of the sequential state passes (one program per (batch, head, V tile) carries ``[K, block_v]``)."""
    block_v_bwd: int | None = None
    """With the delta rule, the reverse state pass's V tile instead of ``block_v`` (``None``: ``block_v``)."""
    shared_memory: int = 48 * 1024
    """Bytes of shared memory (LDS) per block on the target GPU; sequential launches' stages are capped to fit."""
    wy: Launch = Launch()
    """The intra-chunk WY transform: ``A``, ``(I + A)^-1``, ``u``, ``w``."""
    state: Launch = Launch()
    """The sequential forward state pass."""
    output: Launch = Launch()
    """The chunk-parallel output launch."""
    state_bwd: Launch = Launch()
    """The sequential reverse state pass (``dh``, ``d(v_new)``)."""
    grad: Launch = Launch()
    """The chunk-parallel gradient pass (its first launch where it is split)."""
    grad_wy: Launch = Launch()
    """The gradient pass's second launch, through the WY transform, where it is split."""
    split_grad_from: int | None = None
    """With the delta rule, the gradient pass is two launches where ``K * V`` reaches this (``None``: always fused)."""
    one_reference_span: int = 32
    """Per-key gate: diagonal blocks in one matmul around their first row, exact where the gate moves by less."""
    levels_chunks: int = 8
    """Chunks per program of the levels launches that redo the rows the one-reference launch got wrong."""
    state_bwd_hdh_from: int | None = None
    """The reverse state pass also computes the gradient pass's ``sum_v h dh`` where ``K * V`` reaches this."""
    output_in_state: bool = False
    """Delta rule: the forward state pass computes the output (``P`` from ``wy``): no output launch."""
    output_in_state_below: int | None = None
    """``output_in_state`` applies only where ``K * V`` is below this (``None``: at every size)."""
    gate_cumsum_in_kernels: bool = False
    """Per-key gate at chunk 16: the kernels sum the raw gate (and reverse-sum its gradient) instead of XLA."""
    chunks_per_program: int = 1
    """Chunks each program of the chunk-parallel launches loops over (with ``num_stages`` 2: prefetch)."""
    chunks_per_program_from: int | None = 0
    """``chunks_per_program`` applies where ``K * V`` reaches this (``None``: never)."""
    documents_branch: bool = False
    """Packed documents: each program of the chunk-parallel launches loads its chunk's flag and runs the kernel with
    the documents' masks only where a new document starts, as without documents elsewhere (one branch per chunk);
    ``False``: the masked kernel on every chunk (no flag load before the chunk's loads; a program's loop over
    chunks keeps its pipelining)."""

    def splits_grad(self, K: int, V: int) -> bool:
        """Whether the gradient pass (delta rule) is two launches at padded head dims ``K``, ``V``."""
        return _from(self.split_grad_from, K, V)

    def chunks_per_program_at(self, K: int, V: int) -> int:
        """Chunks per program of the chunk-parallel launches at padded head dims ``K``, ``V``."""
        return max(1, self.chunks_per_program) if _from(self.chunks_per_program_from, K, V) else 1

    def output_in_state_at(self, K: int, V: int) -> bool:
        """Whether the forward state pass computes the output (delta rule) at padded head dims ``K``, ``V``."""
        return self.output_in_state and (self.output_in_state_below is None or K * V < self.output_in_state_below)

    def hdh_in_state_bwd(self, K: int, V: int) -> bool:
        """Whether the reverse state pass computes ``sum_v h dh`` at padded head dims ``K``, ``V``."""
        return _from(self.state_bwd_hdh_from, K, V)

    def state_bwd_block_v(self, delta: bool) -> int:
        """The reverse state pass's V tile before clipping to V."""
        return (self.block_v_bwd if delta else None) or self.block_v

    def sums_gate(self, per_key: bool, chunk: int) -> bool:
        """Whether the kernels take the raw gate and sum it themselves: ``gate_cumsum_in_kernels`` with a per-key
        gate at chunk 16 only, where a chunk is one row block (so the gradient pass's levels launch, which rewrites
        whole blocks, also rewrites every row the reverse sum of the gate's gradient mixes); elsewhere XLA sums."""
        return self.gate_cumsum_in_kernels and per_key and chunk == 16


def _from(threshold: int | None, K: int, V: int) -> bool:
    """A config rule on the padded head dims: ``K * V`` at least ``threshold`` (``None``: never)."""
    return threshold is not None and K * V >= threshold


def override(cfg: RecurrentConfig, text: str) -> RecurrentConfig:
    """``cfg`` with ``FIELD=VALUE[,FIELD=VALUE...]`` changed: VALUE ``true``/``false``/``none`` or an integer; FIELD a
    field of :class:`RecurrentConfig` or ``KERNEL.FIELD`` of one launch (e.g. ``grad.num_stages=2``). An unknown
    field is a ``ValueError`` naming the fields there are."""
    words = {"true": True, "false": False, "none": None}
    for item in text.split(","):
        field, _, text_value = item.partition("=")
        kernel, _, launch_field = field.rpartition(".")
        owner = getattr(cfg, kernel, None) if kernel else cfg
        names = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
        if (launch_field if kernel else field) not in names or (kernel and not isinstance(owner, Launch)):
            raise ValueError(f"unknown config field {field!r} in {text!r}: fields are "
                             f"{[f.name for f in dataclasses.fields(cfg)]} and KERNEL.num_warps / KERNEL.num_stages")
        try:
            value = words[text_value.lower()] if text_value.lower() in words else int(text_value)
        except ValueError:
            raise ValueError(f"{field}: value {text_value!r} must be an integer, true, false or none") from None
        if kernel:
            value = dataclasses.replace(owner, **{launch_field: value})
        cfg = dataclasses.replace(cfg, **{kernel or field: value})
    return cfg


def fit_stages(launch: Launch, bytes_per_stage: int, shared_memory: int) -> Launch:
    """``launch`` with no more pipeline stages than fit ``shared_memory`` (at least one).

    Triton keeps each stage's copy of a loop iteration's loads in shared memory, so a launch tuned at one chunk can
    overflow at a longer one. An eighth of the memory is left for layout conversions."""
    fit = max(1, shared_memory * 7 // 8 // bytes_per_stage)
    return launch if launch.num_stages <= fit else dataclasses.replace(launch, num_stages=fit)


# The tables: evidence in benchmarks/NOTES.md, one section per entry (named in the comment beside it).
RECURRENT: dict[str, RecurrentConfig] = {
    "sm90": RecurrentConfig(  # NOTES.md "sm90 GDN table"
        block_v=64,
        block_v_bwd=32,
        shared_memory=227 * 1024,
        wy=Launch(4, 2),
        state=Launch(4, 2),
        output=Launch(4, 2),
        state_bwd=Launch(4, 2),
        grad=Launch(8, 1),
        split_grad_from=128 * 128,
        grad_wy=Launch(4, 1),
        documents_branch=True,  # NOTES.md "option evidence: documents_branch"
    ),
    "gfx942": RecurrentConfig(  # NOTES.md "ROCm tables": untimed on AMD GPUs, compiled offline without spills
        block_v=32,
        shared_memory=64 * 1024,
        wy=Launch(4, 1),
        state=Launch(4, 1),
        output=Launch(4, 1),
        state_bwd=Launch(4, 1),
        grad=Launch(4, 1),
        split_grad_from=128 * 128,
        grad_wy=Launch(4, 1),
    ),
    "gfx950": RecurrentConfig(  # NOTES.md "ROCm tables"
        block_v=64,
        shared_memory=160 * 1024,
        wy=Launch(4, 1),
        state=Launch(4, 1),
        output=Launch(4, 1),
        state_bwd=Launch(4, 1),
        grad=Launch(4, 1),
        split_grad_from=128 * 128,
        grad_wy=Launch(4, 1),
    ),
    "fallback": RecurrentConfig(),
}

# KDA (per-key gate): chunk 16, the gradient pass always split.
RECURRENT_KDA: dict[str, RecurrentConfig] = {
    "sm90": dataclasses.replace(  # NOTES.md "sm90 KDA table"
        RECURRENT["sm90"],
        chunk=16,
        block_v_bwd=None,
        wy=Launch(2, 2),
        state=Launch(4, 3),
        output=Launch(2, 3),
        state_bwd=Launch(4, 3),
        split_grad_from=0,
        state_bwd_hdh_from=128 * 128,
        grad=Launch(4, 2),
        grad_wy=Launch(4, 2),
        output_in_state=True,
        output_in_state_below=128 * 128,  # NOTES.md "option evidence: output_in_state"
        gate_cumsum_in_kernels=True,
        chunks_per_program=4,
        chunks_per_program_from=128 * 128,
        documents_branch=False,
    ),
    # NOTES.md "ROCm tables": the GDN entries at chunk 16, 8-warp grad (no spills offline)
    "gfx942": dataclasses.replace(RECURRENT["gfx942"], chunk=16, split_grad_from=0, grad=Launch(8, 1)),
    "gfx950": dataclasses.replace(RECURRENT["gfx950"], chunk=16, split_grad_from=0, grad=Launch(8, 1)),
    "fallback": RecurrentConfig(chunk=16),
}


# Entries for one op at padded head dims ``(K, V)`` over its architecture's entry: the tuner's winners that training
# tokens/s confirmed (``(arch, op, K, V)``; a user's tuning file still comes first).
RECURRENT_AT_DIMS: dict[tuple[str, str, int, int], RecurrentConfig] = {
    ("sm90", "gdn", 64, 64): dataclasses.replace(  # NOTES.md "sm90 GDN at K = V = 64"
        RECURRENT["sm90"],
        block_v=32,
        block_v_bwd=64,
        wy=Launch(4, 3),
        state=Launch(4, 3),
        output=Launch(4, 1),
        state_bwd=Launch(4, 3),
        grad=Launch(4, 3),
        grad_wy=Launch(4, 1),
    ),
    ("sm90", "gla", 64, 64): dataclasses.replace(  # NOTES.md "sm90 GLA at K = V = 64"
        RECURRENT["sm90"],
        block_v=128,
        state=Launch(4, 3),
        state_bwd=Launch(4, 3),
        grad=Launch(4, 2),
    ),
}


def arch_of(device_kind: str, platform: str) -> str:
    """Map a device kind (``jax.devices()[0].device_kind``) and platform to a table key."""
    kind = device_kind.lower()
    if platform == "rocm" or kind.startswith("gfx") or "instinct" in kind:
        if "gfx950" in kind or "mi35" in kind:
            return "gfx950"
        if "gfx942" in kind or "mi30" in kind:
            return "gfx942"
        return "fallback"
    if any(name in kind for name in ("h100", "h200", "h800", "gh200")):
        return "sm90"
    return "fallback"


class TargetDevice(NamedTuple):
    """The kind of device a computation is built for."""

    device_kind: str
    platform: str  # "gpu" or "cpu" (JAX's name for CUDA and ROCm devices alike)
    cores: int | None  # SMs or CUs (None where the device does not say)


def target_device() -> TargetDevice:
    """The devices the computation being traced is for: the current mesh's (``jax.set_mesh``; also a mesh of
    compile-only GPUs that this machine does not have: ``benchmarks/plan_memory.py --gpu``), else the default
    device."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = None if mesh.empty else mesh.abstract_device
    if dev is not None:
        return TargetDevice(dev.device_kind, dev.platform, dev.num_cores)
    dev = jax.devices()[0]
    return TargetDevice(dev.device_kind, dev.platform, getattr(dev, "core_count", None))


def current_arch() -> str:
    """The table key of :func:`target_device` (``fallback`` on CPU)."""
    dev = target_device()
    return arch_of(dev.device_kind, dev.platform)


def recurrent_op(per_key: bool, delta: bool) -> str:
    """The op name (tuning files' key) of a chunked recurrence with this gate kind: ``kernels.registry``'s map, which
    imports this module (hence imported here, when first called)."""
    from hybrid_jax.kernels import registry

    return registry.recurrent_op(per_key, delta)


def recurrent_config(arch: str | None = None, per_key: bool = False, op: str | None = None,
                     dims: tuple[int, int] | None = None) -> RecurrentConfig:
    """The recurrent-kernel config for ``arch``'s built-in table (``None``: the current device); ``per_key``: KDA's
    table. With ``op`` (``gdn`` / ``kda`` / ``gla``) and padded head ``dims`` ``(K, V)``, an entry of
    :data:`RECURRENT_AT_DIMS` for that shape comes before the architecture's, and with ``arch=None`` the entry of the
    tuning file in use for that shape before both (``kernels/tuning_file.py``)."""
    if arch is None and op is not None and dims is not None:
        from hybrid_jax.kernels import tuning_file

        tf = tuning_file.active()
        if tf is not None and (op, *dims) in tf.recurrent:
            return tf.recurrent[(op, *dims)]
    arch = current_arch() if arch is None else arch
    if op is not None and dims is not None and (arch, op, *dims) in RECURRENT_AT_DIMS:
        return RECURRENT_AT_DIMS[(arch, op, *dims)]
    table = RECURRENT_KDA if per_key else RECURRENT
    return table.get(arch, table["fallback"])


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """Tiles of one flash-attention kernel: ``block_q`` query rows x ``block_k`` key rows (powers of two)."""

    block_q: int = 64
    block_k: int = 64
    launch: Launch = Launch()


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """``kernels/flash_attention.py``: forward, dK/dV (loops over queries) and dQ (loops over keys) kernels."""

    fwd: AttentionKernel = AttentionKernel()
    dkdv: AttentionKernel = AttentionKernel()
    dq: AttentionKernel = AttentionKernel()


# Keyed by (arch, padded head dim 64 or 128), bf16 inputs; a float32 input halves block_k (see flash_attention.py).
# Evidence: NOTES.md "attention tables".
ATTENTION: dict[tuple[str, int], AttentionConfig] = {
    ("sm90", 64): AttentionConfig(
        fwd=AttentionKernel(64, 64, Launch(4, 3)),
        dkdv=AttentionKernel(64, 64, Launch(4, 3)),
        dq=AttentionKernel(64, 64, Launch(4, 3)),
    ),
    ("sm90", 128): AttentionConfig(
        fwd=AttentionKernel(128, 128, Launch(8, 3)),
        dkdv=AttentionKernel(64, 128, Launch(8, 2)),
        dq=AttentionKernel(128, 32, Launch(4, 3)),
    ),
    # 64 KiB LDS, single stage: 64-row key tiles (ROCm/jax#147).
    ("gfx942", 64): AttentionConfig(
        fwd=AttentionKernel(128, 64, Launch(4, 1)),
        dkdv=AttentionKernel(64, 64, Launch(4, 1)),
        dq=AttentionKernel(64, 64, Launch(4, 1)),
    ),
    ("gfx942", 128): AttentionConfig(
        fwd=AttentionKernel(64, 64, Launch(4, 1)),
        dkdv=AttentionKernel(32, 64, Launch(4, 1)),
        dq=AttentionKernel(64, 32, Launch(4, 1)),
    ),
    ("gfx950", 64): AttentionConfig(
        fwd=AttentionKernel(128, 64, Launch(4, 1)),
        dkdv=AttentionKernel(64, 64, Launch(4, 1)),
        dq=AttentionKernel(64, 64, Launch(4, 1)),
    ),
    ("gfx950", 128): AttentionConfig(
        fwd=AttentionKernel(128, 64, Launch(8, 1)),
        dkdv=AttentionKernel(64, 64, Launch(8, 1)),
        dq=AttentionKernel(64, 64, Launch(8, 1)),
    ),
}


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    """The cross-entropy's softmax-gradient kernel (``kernels/cross_entropy.py``): ``rows`` logits rows per program
    (reduced to a divisor of the chunk), each row swept in ``block_v``-wide column tiles."""

    rows: int = 4
    block_v: int = 1024
    launch: Launch = Launch(4, 1)


# Evidence: NOTES.md "cross-entropy kernel". Other GPUs (gfx942 and gfx950 too, untimed) take the defaults.
CROSS_ENTROPY: dict[str, CrossEntropyConfig] = {
    "sm90": CrossEntropyConfig(rows=1, block_v=4096, launch=Launch(4, 2)),
}


@dataclasses.dataclass(frozen=True)
class ElementwiseConfig:
    """An element-wise kernel over a flattened tensor (``kernels/swiglu.py``): ``block`` elements per program. One
    launch for every GPU: on the H200 1,024-4,096 elements at 4 or 8 warps time alike (NOTES.md "SwiGLU backward
    kernel")."""

    block: int = 2048
    launch: Launch = Launch(4, 1)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """The RMSNorm kernels (``kernels/gated_norm.py``, ``kernels/rms_norm.py``): tiles of about ``block`` elements
    (whole rows of the norm), one program per tile forward; backward at most ``programs`` programs take the tiles in
    turn (each one partial sum of the weight's gradient). One launch for every GPU."""

    block: int = 2048
    programs: int = 1024
    launch: Launch = Launch(4, 1)

    def tile_rows(self, d: int, weight_groups: int = 1) -> int:
        """Rows of ``d`` elements (padded to a power of two) per tile: the most rows, a power of two, that fit in
        ``block`` elements, at least one and at least ``weight_groups`` (a power of two: the rows a weight's copies
        cover)."""
        fit = max(self.block // _next_power_of_2(d), 1)
        return max(1 << (fit.bit_length() - 1), weight_groups)

    def backward_programs(self, tiles: int) -> tuple[int, int]:
        """``(programs, tiles per program)`` of a backward launch over ``tiles`` tiles."""
        per_program = -(-tiles // min(self.programs, tiles))
        return -(-tiles // per_program), per_program


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class ShortConvConfig:
    """The short conv's two backward kernels (``kernels/short_conv.py``): ``rows x channels`` tiles (powers of two);
    the first kernel's programs take ``tiles`` row tiles in turn (fewer partial ``dw`` / ``dbias`` sums). One launch
    for every GPU: the H200 sweep's best over Mamba2's conv (C 3072, bias) and GDN's (C 1024) at 8 x 2048."""

    rows: int = 16
    channels: int = 64
    launch: Launch = Launch(8, 1)
    tiles: int = 4


def cross_entropy_config(arch: str | None = None) -> CrossEntropyConfig:
    """The softmax-gradient kernel's entry for ``arch`` (default: the current device)."""
    return CROSS_ENTROPY.get(current_arch() if arch is None else arch, CrossEntropyConfig())


def attention_config(arch: str | None = None, head_dim: int = 128) -> AttentionConfig:
    """The flash-attention config for ``arch`` (default: the current device, where the tuning file in use comes
    first) and a padded head dim."""
    if arch is None:
        from hybrid_jax.kernels import tuning_file

        tf = tuning_file.active()
        if tf is not None and head_dim in tf.attention:
            return tf.attention[head_dim]
    key = (current_arch() if arch is None else arch, 64 if head_dim <= 64 else 128)
    return ATTENTION.get(key, AttentionConfig()) if head_dim <= 128 else AttentionConfig()
