"""Block sizes, warps and stages for the Pallas (Triton-lowered) kernels, keyed by GPU architecture.

Architectures: ``sm90`` (H100/H200, 227 KiB shared memory per block), ``gfx942`` (MI300X, 64 KiB LDS,
wave64), ``gfx950`` (MI355X, 160 KiB LDS, wave64) and ``fallback`` (conservative, any GPU).
``benchmarks/autotune.py`` sweeps candidates on a GPU and prints an entry for this table.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Launch:
    """Triton launch parameters of one kernel."""

    num_warps: int = 4
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Chunk length and launch parameters of the chunked recurrent kernels (``kernels/chunk_pallas.py``).

    ``chunk``: the chunk length used when the caller passes ``chunk_size=None`` (a power of two >= 16).
    ``block_v`` tiles the value dim of the sequential state kernels (one program per (batch, head, V-tile)
    carries a ``[K, block_v]`` float32 state); it is clipped to V. ``block_v_bwd``: with the delta rule, the
    reverse state pass's V tile instead (``None``: ``block_v``); on the H200 32 against 64 takes GDN's reverse pass
    from 0.475 to 0.347 ms at its anchor, but Mamba2's (no delta rule) from 0.138 to 0.206 at its 300M shape.
    ``inverse_bf16x3``: the float32 matmuls of the triangular inverse as three bf16 tensor-core matmuls each (else
    IEEE float32 dots).
    ``split_grad_from``: with the delta rule and ``K * V`` (padded head dims) at least this, the gradient pass is
    two launches (``grad``: through the output and state update; ``grad_wy``: through the WY transform, adding the
    first's dk and d(gamma) to its own) instead of one fused kernel (``None``: always fused).
    ``decay_operands_f32`` (per-key gate only): the forward's decayed
    Gram products (``A`` in ``wy``, ``P`` in ``output``) from float32 operands (TF32 tensor cores on NVIDIA) instead
    of input-dtype ones: less rounding, more registers. ``shared_memory``: bytes of shared memory (LDS) per block on
    the target GPU; the sequential kernels' pipeline stages are capped to fit it (:func:`fit_stages`).
    ``block_k`` tiles the key dim of the gradient pass (``None``: all of K, clipped to K): one program per (chunk,
    K tile) holds that tile's columns of q, k and the gate and its rows of the state snapshots; the value-space
    products are recomputed in each tile; on the H200 at K = 128 that is slower (GDN fwd+bwd 2.53 -> 2.86 ms at
    ``block_k=64``, KDA 5.26 -> 5.75), so every table leaves it off.
    ``one_reference_span`` (per-key gate): inside a 16-row diagonal block, one matmul around the block's first row
    instead of one per level of the hierarchical factorisation (log2(16) = 4), exact where the cumulated gate moves
    by less than this from that row (factors up to ``exp(span)``); a second launch with the levels rewrites the other
    rows in place (``wy``, ``output``, ``grad``, ``grad_wy``); 0: the levels alone. Bf16 and float32 operands only.
    On the H200 at the KDA anchor, against 0: the forward 9-16% less, the forward+backward 4-7% less, the gradient
    pass 8-16% less (four commands). Compiled offline for sm90 the first launches execute 41-61% fewer instructions
    and no longer spill. ``levels_chunks``: chunks per program of those second launches (the largest power of two
    up to it that divides the chunk count); a program whose chunks all keep within the span exits after loading
    their flags. On the H200, 8 against the previous form (one chunk per program, each loading its gate): KDA anchor
    fwd+bwd 4.567 -> 4.184 ms (no chunk far), and 9-22% slower at the anchor and the 1B shape with nearly every
    chunk far (``one_reference_span=1``).
    ``state_bwd_hdh_from``: with ``K * V`` (padded head dims) at least this, the reverse state pass also computes
    the gradient pass's ``sum_v h dh`` per chunk (from its float32 carry and the forward's snapshot of ``h``), so
    that the gradient kernel does not multiply the two ``[K, V]`` snapshots (``None``: never). Compiled for sm90 at
    the KDA anchor that takes ``grad`` from 178 to 128 registers and adds spills to ``state_bwd``; on the H200 it
    pays at the KDA anchor and costs at K = 32 and at GDN's anchor (see the KDA table).
    ``output_in_state`` (delta rule): the forward's output computed in the sequential state pass, per V tile, from
    the carried state (``o = (scale Q exp(gamma)) h + P v_new``), with ``P`` stored by ``wy``, which forms the same
    gate factors for ``A``: no output launch and no snapshot read for it, two more products per sequential step (off
    the carried chain). On in the sm90 KDA table (with the next option; see there).
    ``gate_cumsum_in_kernels`` (per-key gate at chunk 16): the kernels take the raw gate and sum each chunk they load
    (a ``[16, 16]`` triangular float32 matmul), and the gradient pass stores the raw gate's gradient (the reverse
    sums), in place of XLA's chunk cumsum and its VJP. At any other chunk (a ``chunk_size`` the caller picks) XLA
    sums the gate as without it. On in the sm90 KDA table.
    ``chunks_per_program`` (with ``K * V``, padded head dims, at least ``chunks_per_program_from``; ``None``: never):
    each program of the chunk-parallel launches (``wy``, ``output``, ``grad``, ``grad_wy``; not the levels launches,
    which take ``levels_chunks``) loops over this many consecutive chunks (the greatest common divisor of it and the
    chunk count) instead of taking one. With the launch's ``num_stages`` at 2 Triton then prefetches the next chunk's
    tiles (the state snapshots among them) while it computes one; without the loop the stages change nothing
    (compiled for sm90 at the KDA model shapes: the same registers and shared memory). On in the sm90 KDA table at
    K = V = 128 (see there); at K = 32, V = 64 and at GDN's anchor it is slower.
    """

    chunk: int = 64
    block_v: int = 32
    inverse_bf16x3: bool = True
    wy: Launch = Launch()  # intra-chunk WY transform: A = KK^T decay, (I + A)^-1, w, u
    state: Launch = Launch()  # sequential inter-chunk state pass (forward)
    output: Launch = Launch()  # parallel output pass
    state_bwd: Launch = Launch()  # sequential reverse pass for dh and d(v_new)
    grad: Launch = Launch()  # parallel gradient pass (dq, dk, dv, dbeta, dg)
    split_grad_from: int | None = None
    grad_wy: Launch = Launch()  # the WY part of the gradient pass when split
    decay_operands_f32: bool = False
    shared_memory: int = 48 * 1024
    block_k: int | None = None
    one_reference_span: int = 32
    levels_chunks: int = 8
    state_bwd_hdh_from: int | None = None
    block_v_bwd: int | None = None
    output_in_state: bool = False
    gate_cumsum_in_kernels: bool = False
    chunks_per_program: int = 1
    chunks_per_program_from: int | None = 0


def fit_stages(launch: Launch, bytes_per_stage: int, shared_memory: int) -> Launch:
    """``launch`` with no more pipeline stages than fit ``shared_memory`` (at least one).

    Triton keeps each stage's copy of a loop iteration's loads in shared memory: on the H200 the GDN state pass at
    chunk 64, K = V = 64 (loads of 24,832 bytes per chunk) allocated exactly 2 x 24,832 bytes at 2 stages. A launch
    tuned at one chunk can therefore overflow at a longer one (KDA's 3-stage state passes, tuned at chunk 16, did
    not launch at chunk 64 and K = 128). An eighth of the memory is left for layout conversions."""
    fit = max(1, shared_memory * 7 // 8 // bytes_per_stage)
    return launch if launch.num_stages <= fit else dataclasses.replace(launch, num_stages=fit)


RECURRENT: dict[str, RecurrentConfig] = {
    # Gradient pass split at K = V = 128 (H200, B8 T2048 H16: fwd+bwd 3.46 -> 2.64 ms, the fused kernel spills);
    # at K = V = 64 the two forms are within 6% either way (300M shape fused 0.79 vs split 0.84 ms; 1B 1.37 vs 1.31).
    # The ROCm entries take the same rule, unmeasured.
    # sm90 block_v_bwd=32 (H200, fwd+bwd ms, the table without -> with, one process each): GDN anchor 2.279 -> 2.158
    # and 2.253 -> 2.206 (the latter with block_v=32 for both state passes), 300M shape 0.655 -> 0.640, 1B shape
    # 1.142 -> 1.123. Mamba2 (no delta rule) keeps block_v: 0.986 -> 1.042 at its 300M shape, 1.549 -> 1.613 at
    # the SSD anchor.
    "sm90": RecurrentConfig(
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
    ),
    # ROCm entries: untimed on AMD GPUs. Compiled offline (benchmarks/kernel_resources.py), the gradient pass at 8
    # warps spills VGPRs at every GDN / GLA shape (gfx942: 190 VGPRs spilled at the 300M GDN shape, 119 at the anchor;
    # gfx950: 125 and 95); at 4 warps it spills none, so 4 it is. Every launch fits the LDS.
    # 64 KiB LDS: keep state tiles small and a single stage.
    "gfx942": RecurrentConfig(
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
    "gfx950": RecurrentConfig(
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

# KDA (per-key gate). Chunk 16. On the H200 (B8 T2048, fwd / fwd+bwd ms), with each decayed product as log2(C)
# masked [C, K] x [K, C] matmuls over the whole chunk (the factorisation before chunks were split into 16-row blocks),
# chunk 64 -> 32 -> 16: anchor H16 K=V=128 4.55/18.07 -> 2.71/8.85 -> 2.40/5.91, 300M shape (H8 K32 V64)
# 0.82/1.86 -> 0.91/1.91 -> 0.68/1.46, 1B shape (H16 K32 V64) 1.29/2.92 -> 1.47/3.21 -> 1.05/2.23, and the forward
# error against float32 drops (6.7e-3 -> 4.9e-3 at the 300M shape). With 16-row blocks (chunk_pallas.SUB, the current
# kernels) chunks 32 / 64 at the 300M shape are 0.46/1.34 and 0.58/1.76 against chunk 16's 0.39/1.10 (tuned), and at
# the anchor (with fit_stages capping the state passes' stages) 2.78/8.36 and 4.96/32.73 against 1.62-1.72/5.15-5.18.
# The gradient pass is always split (at chunk 64: 2.40 -> 1.92 ms at the 300M shape, 3.44 -> 3.05 ms at the 1B
# shape, equal at K = V = 128).
# sm90: ``benchmarks/autotune.py --shape kda_300m kda_1b kda_anchor`` at chunk 16 (sum over the three shapes, ms):
# wy 8 warps/2 stages -> 4/1: 1.85 -> 1.07; state 4/2 -> 4/3: 1.31 -> 1.04; output 8/2 -> 2/3: 1.83 -> 1.15;
# state_bwd 4/2 -> 4/3: 1.81 -> 1.67; grad and block_v unchanged. The ROCm entries are the GDN launches at chunk 16
# with the split gradient pass and 8-warp `grad`, untimed.
# Round 13 (back-to-back timing, one process, table -> variant, fwd+bwd ms, anchor / 300M / 1B shape):
# wy 4 -> 2 warps 3.518 -> 3.513, 0.628 -> 0.617, 1.002 -> 0.992 (forward 1.034 -> 1.023, 0.203 -> 0.194,
# 0.314 -> 0.290); GDN's block_v_bwd=32 3.518 -> 3.911, 0.628 -> 0.612, 1.002 -> 1.041 (KDA keeps block_v);
# chunk 32 at the anchor 3.562 -> 5.534. A sweep of every launch at the anchor found nothing else faster by over 2%.
# Round 14: chunk 32 with launches that spill only in output (offline: wy 4 warps, output 4, state_bwd and grad_wy
# 8) 3.469 -> 4.508 at the anchor, 0.606 -> 1.034 and 0.976 -> 1.801 at the 300M / 1B shapes.
# ``state_bwd_hdh_from`` at K * V >= 128 * 128 only. Two H200s of one host, each timing the build without it and
# with it everywhere (fwd+bwd ms, without -> with): KDA anchor 4.080 -> 3.952 and 4.328 -> 3.991 (``grad`` 2.09 ->
# 1.73, ``state_bwd`` 0.71 -> 0.85-0.97); 1B shape 1.286 -> 1.471, 1.385 -> 1.398; 300M shape 0.851 -> 1.028,
# 0.879 -> 0.932; GDN anchor 2.599 -> 2.732, 2.592 -> 2.652. ROCm: untimed, left off.
# Round 16 (one process per command, fwd+bwd ms, anchor / 300M / 1B shape): ``output_in_state`` and
# ``gate_cumsum_in_kernels`` together 3.564 -> 3.251, 0.610 -> 0.588, 0.968 -> 0.948 (each alone at the anchor:
# 3.630, 3.362); with them ``grad`` at 4 warps (8 before) 3.232 -> 3.195, 0.592 -> 0.547, 0.953 -> 0.863, and the
# whole change against the old entry in one process 3.487 -> 3.234, 0.611 -> 0.546, 0.997 -> 0.846 (our GDN anchor
# 2.104: 1.54x). Not taken: the fused gradient pass 3.220, ``state_bwd_hdh_from=None`` 3.457. ROCm: untimed, off.
# Round 17 (one process, fwd+bwd ms, the table -> 4 chunks per program with 2 stages in wy, grad and grad_wy): anchor
# 3.246 -> 2.829 (grad 1.485 -> 1.086, wy 0.306 -> 0.281; our GDN anchor 2.141: 1.52x -> 1.32x), 300M shape 0.551 ->
# 0.602, 1B shape 0.837 -> 0.905 (2 chunks: 2.872, 0.576, 0.898), so only from K * V = 128 * 128; the GDN table keeps
# one chunk per program (its anchor 2.141 -> 2.384). ROCm: untimed, off.
RECURRENT_KDA: dict[str, RecurrentConfig] = {
    "sm90": dataclasses.replace(
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
        gate_cumsum_in_kernels=True,
        chunks_per_program=4,
        chunks_per_program_from=128 * 128,
    ),
    # KDA's gradient pass keeps 8 warps on ROCm: it spills nothing there (at most 214 VGPRs, offline compile).
    "gfx942": dataclasses.replace(RECURRENT["gfx942"], chunk=16, split_grad_from=0, grad=Launch(8, 1)),
    "gfx950": dataclasses.replace(RECURRENT["gfx950"], chunk=16, split_grad_from=0, grad=Launch(8, 1)),
    "fallback": RecurrentConfig(chunk=16),
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


def current_arch() -> str:
    """The table key of the default device (``fallback`` on CPU)."""
    dev = jax.devices()[0]
    return arch_of(dev.device_kind, dev.platform)


def recurrent_config(arch: str | None = None, per_key: bool = False) -> RecurrentConfig:
    """The recurrent-kernel config for ``arch`` (default: the current device); ``per_key``: KDA's table."""
    table = RECURRENT_KDA if per_key else RECURRENT
    return table.get(current_arch() if arch is None else arch, table["fallback"])


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
ATTENTION: dict[tuple[str, int], AttentionConfig] = {
    # sm90: the best of benchmarks/attention.py --sweep on an H200 (B8 T2048 H16, bf16, causal).
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


def attention_config(arch: str | None = None, head_dim: int = 128) -> AttentionConfig:
    """The flash-attention config for ``arch`` (default: the current device) and a padded head dim."""
    key = (current_arch() if arch is None else arch, 64 if head_dim <= 64 else 128)
    return ATTENTION.get(key, AttentionConfig()) if head_dim <= 128 else AttentionConfig()
