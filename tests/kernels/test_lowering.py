"""Lower the Pallas kernels to Triton for ROCm (gfx942, gfx950) and CUDA (H200) on a CPU-only machine.

A kernel that the Triton lowering rejects (a non-power-of-two block, a 3-D dot, a reverse cumsum, ...)
fails here instead of on the GPU. Shared-memory overflow is not caught: it shows only when compiled on
the device. To add a kernel, append a :class:`Case` to ``CASES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest

from hybrid_jax.kernels.flash_attention import flash_attention
from hybrid_jax.kernels.recurrent import backward as recurrent_backward
from hybrid_jax.kernels.recurrent import chunk_recurrence
from hybrid_jax.kernels.recurrent import forward as recurrent_forward
from hybrid_jax.kernels.tuning import Launch, attention_config, fit_stages, recurrent_config

TRITON_CALL = "__gpu$xla.gpu.triton"
TARGETS = [("NVIDIA H200", "cuda", "sm90"), ("gfx942", "rocm", "gfx942"), ("gfx950", "rocm", "gfx950")]


@dataclasses.dataclass(frozen=True)
class Case:
    """``make(arch)`` returns the function to lower; ``args`` are its ``ShapeDtypeStruct`` arguments;
    the lowered text must hold at least ``triton_calls`` Triton custom calls."""

    name: str
    make: Callable[[str], Callable]
    args: tuple[jax.ShapeDtypeStruct, ...]
    triton_calls: int


def _sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _recurrence_case(name: str, delta: bool, backward: bool, per_key: bool = False, split: bool = False,
                     chunk: int | None = None, fused: bool = False, hdh: bool = False,
                     output_in_state: bool | None = None, gate_sums: bool | None = None,
                     per_program: int | None = None, segments: bool = False) -> Case:
    """GDN (delta), KDA (delta, ``per_key`` gate [B,T,HV,K]) or GLA at a 300M-like shape: 2 q/k heads, 4 value
    heads, K=V=64, T ragged (200). ``split`` / ``fused``: the gradient pass as two launches / one (else the table's
    rule); ``chunk``: instead of the table's (KDA at 64: four 16-row blocks per chunk); ``hdh``: the reverse state
    pass computes ``sum_v h dh`` (``state_bwd_hdh_from``); ``output_in_state``: the forward state pass computes the
    output (``P`` from ``wy``, no output launch); ``gate_sums``: the kernels sum the raw gate
    (``gate_cumsum_in_kernels``); these two, None: as the table has them (the sm90 KDA table sets both);
    ``per_program``: the chunk-parallel launches loop over this many chunks per program (``chunks_per_program``, at
    T = 256 so that it divides the chunk count); ``segments``: with packed documents (``segment_ids [B,T]``)."""
    B, T, H, HV, K, V = 1, 200 if per_program is None else 256, 2, 4, 64, 64
    g_shape = (B, T, HV, K) if per_key else (B, T, HV)
    args = (_sds(B, T, H, K), _sds(B, T, H, K), _sds(B, T, HV, V), _sds(*g_shape, dtype=jnp.float32),
            _sds(B, T, HV), _sds(B, HV, K, V, dtype=jnp.float32)) + ((_sds(B, T, dtype=jnp.int32),) if segments else ())

    def make(arch: str) -> Callable:
        def f(q, k, v, g, beta, h0, seg=None):
            config = recurrent_config(arch, per_key=per_key)
            config = dataclasses.replace(config, split_grad_from=0) if split else config
            config = dataclasses.replace(config, split_grad_from=None) if fused else config
            config = dataclasses.replace(config, state_bwd_hdh_from=0) if hdh else config
            config = config if output_in_state is None else dataclasses.replace(config, output_in_state=output_in_state)
            config = config if gate_sums is None else dataclasses.replace(config, gate_cumsum_in_kernels=gate_sums)
            config = config if per_program is None else dataclasses.replace(
                config, chunks_per_program=per_program, chunks_per_program_from=0)
            return chunk_recurrence(q, k, v, g, beta if delta else None, initial_state=h0, use_qk_l2norm=True,
                                    config=config, chunk_size=chunk, segment_ids=seg)

        if not backward:
            return f

        def fwd_bwd(*xs):
            out, vjp = jax.vjp(lambda *floats: f(*floats, *xs[6:]), *xs[:6])
            return vjp(out)

        return fwd_bwd

    no_output_launch = delta and output_in_state is not False  # None: the table may compute it in the state pass
    kernels = (3 if delta else 2) - no_output_launch + (2 + split if backward else 0)
    return Case(name, make, args, kernels)


def _attention_case(T: int, dqk: int, dv: int, segments: bool = False) -> Case:
    """Flash attention forward + backward (fwd, dK/dV, dQ kernels) with the architecture's tiles; ``segments``:
    with packed documents."""

    def make(arch: str) -> Callable:
        config = attention_config(arch, max(dqk, dv))
        loss = lambda q, k, v, seg=None: flash_attention(q, k, v, config=config, segment_ids=seg).astype(  # noqa
            jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))

    args = (_sds(2, T, 4, dqk), _sds(2, T, 4, dqk), _sds(2, T, 4, dv)) + ((_sds(2, T, dtype=jnp.int32),) if segments
                                                                          else ())
    return Case(f"attention_T{T}_qk{dqk}_v{dv}" + ("_segments" if segments else ""), make, args, 3)


CASES = [
    _recurrence_case("gdn_fwd", delta=True, backward=False),
    _recurrence_case("gdn_fwd_bwd", delta=True, backward=True),
    _recurrence_case("gla_fwd", delta=False, backward=False),
    _recurrence_case("gla_fwd_bwd", delta=False, backward=True),
    _recurrence_case("kda_fwd", delta=True, backward=False, per_key=True),
    _recurrence_case("kda_fwd_bwd", delta=True, backward=True, per_key=True),
    _recurrence_case("gdn_fwd_bwd_split_grad", delta=True, backward=True, split=True),
    _recurrence_case("kda_fwd_bwd_split_grad", delta=True, backward=True, per_key=True, split=True),
    _recurrence_case("kda_chunk64_fwd_bwd_split_grad", delta=True, backward=True, per_key=True, split=True, chunk=64),
    _recurrence_case("kda_chunk64_fwd_bwd_fused_grad", delta=True, backward=True, per_key=True, fused=True, chunk=64),
    _recurrence_case("gdn_fwd_bwd_hdh_in_state_bwd", delta=True, backward=True, hdh=True),
    _recurrence_case("kda_fwd_bwd_split_grad_hdh_in_state_bwd", delta=True, backward=True, per_key=True, split=True,
                     hdh=True),
    _recurrence_case("gdn_fwd_bwd_output_in_state", delta=True, backward=True, output_in_state=True),
    _recurrence_case("kda_fwd_bwd_split_grad_output_in_state", delta=True, backward=True, per_key=True, split=True,
                     output_in_state=True),
    _recurrence_case("kda_fwd_bwd_split_grad_gate_sums_in_kernels", delta=True, backward=True, per_key=True,
                     split=True, gate_sums=True),
    _recurrence_case("kda_fwd_bwd_fused_grad_gate_sums_in_kernels", delta=True, backward=True, per_key=True,
                     fused=True, gate_sums=True),
    _recurrence_case("gdn_fwd_bwd_chunks_per_program", delta=True, backward=True, per_program=4),
    _recurrence_case("kda_fwd_bwd_split_grad_chunks_per_program", delta=True, backward=True, per_key=True, split=True,
                     per_program=4),
    _recurrence_case("gdn_fwd_bwd_segments", delta=True, backward=True, segments=True),
    _recurrence_case("gla_fwd_bwd_segments", delta=False, backward=True, segments=True),
    _recurrence_case("kda_fwd_bwd_split_grad_segments", delta=True, backward=True, per_key=True, split=True,
                     segments=True),
    _recurrence_case("gdn_fwd_bwd_chunks_per_program_segments", delta=True, backward=True, per_program=4,
                     segments=True),
    _recurrence_case("gdn_fwd_bwd_output_in_state_hdh_segments", delta=True, backward=True, output_in_state=True,
                     hdh=True, segments=True),
    _attention_case(300, 48, 32, segments=True),
    _attention_case(2048, 64, 64),
    _attention_case(2048, 128, 128),
    _attention_case(300, 48, 32),
]


@pytest.mark.parametrize("target", TARGETS, ids=[t[2] for t in TARGETS])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lowers_to_triton(case: Case, target):
    kind, platform, arch = target
    assert _lower(case.make(arch), case.args, kind, platform).count(TRITON_CALL) >= case.triton_calls


def _lower(fn: Callable, args: tuple, kind: str, platform: str) -> str:
    """The text of ``fn`` lowered for a device of ``kind`` on ``platform`` (none needs to be present)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(kind, 1, platform))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_fit_stages():
    assert fit_stages(Launch(4, 3), 18_432, 227 * 1024) == Launch(4, 3)
    assert fit_stages(Launch(4, 3), 73_728, 227 * 1024) == Launch(4, 2)  # 3 x 72 KiB > 7/8 of 227 KiB
    assert fit_stages(Launch(8, 2), 10**9, 64 * 1024) == Launch(8, 1)  # at least one stage


@pytest.mark.parametrize("per_key, K, V, chunk, stages", [
    (False, 64, 64, 64, (2, 2)),  # GDN at the 300M shape: the table's launches fit
    (True, 128, 128, 16, (3, 3)),  # KDA at the anchor, its tuned chunk: unchanged
    (True, 128, 128, 64, (2, 2)),  # KDA at chunk 64: the 3-stage launches tuned at chunk 16 would overflow
])
def test_state_passes_fit_shared_memory(monkeypatch, per_key, K, V, chunk, stages):
    """The sequential kernels' stages are capped by shared memory, with a stage's bytes as Triton allocates them:
    the H200's GDN state pass at the 300M shape allocated 49,664 bytes = 2 stages x 24,832."""
    calls = []

    def spy(launch, per_stage, shared_memory):
        fitted = fit_stages(launch, per_stage, shared_memory)
        calls.append((per_stage, fitted.num_stages))
        return fitted

    monkeypatch.setattr(recurrent_forward, "fit_stages", spy)
    monkeypatch.setattr(recurrent_backward, "fit_stages", spy)
    B, T, H, HV = 1, 128, 2, 2
    args = (_sds(B, T, H, K), _sds(B, T, H, K), _sds(B, T, HV, V),
            _sds(*((B, T, HV, K) if per_key else (B, T, HV)), dtype=jnp.float32), _sds(B, T, HV))
    config = recurrent_config("sm90", per_key=per_key)

    def loss(*xs):
        return chunk_recurrence(*xs, config=config, chunk_size=chunk)[0].astype(jnp.float32).sum()

    _lower(jax.grad(loss, argnums=(0, 1, 2)), args, "NVIDIA H200", "cuda")
    assert [n for _, n in calls] == list(stages)  # state_fwd, then state_bwd
    if not per_key:
        assert calls[0][0] == 24_832
