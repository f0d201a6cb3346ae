"""Lower the Pallas kernels to Triton for ROCm (gfx942, gfx950) and CUDA (H200) on a CPU-only machine.

A kernel that the Triton lowering rejects (a non-power-of-two block, a 3-D dot, a reverse cumsum, ...) fails here
instead of on the GPU. Shared-memory overflow is not caught: it shows only when compiled on the device. To add a
kernel, append a case to ``CASES``: a problem, a config variant (``tuning.override``'s syntax), packed documents or
not (forward + backward: that lowers every forward launch too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from benchmarks.context_shard import OneDevice
from hybrid_jax.kernels.recurrent import backward as recurrent_backward
from hybrid_jax.kernels.recurrent import forward as recurrent_forward
from hybrid_jax.kernels.short_conv import short_conv_silu
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, kernel_case, lower, lowered_kernels
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tuning import fit_stages, override, recurrent_config
from hybrid_jax.parallel import recurrence


def model_like(op: str, *, chunk: int = 0, T: int = 200) -> Problem:
    """GDN, KDA or GLA at a 300M-like shape: 2 q/k heads, 4 value heads, K=V=64, T ragged (200); ``chunk``: instead of
    the table's (KDA at 64: four 16-row blocks per chunk); T 256 where chunks per program must divide the chunks."""
    return Problem(op, 1, T, 2, 4, 64, 64, chunk=chunk)


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One lowering test: ``problem``'s forward + backward, with the arch's table entry changed by ``variant``, with
    packed documents if ``segments``."""

    name: str
    problem: Problem
    variant: str = ""
    segments: bool = False

    def triton_calls(self, arch: str) -> int:
        """The Pallas launches the lowered text must hold at least: wy (delta rule), state, output (unless the
        config computes it in the state pass), state_bwd, grad (and grad_wy where split)."""
        p = self.problem
        if not p.recurrent:
            return 3
        cfg = recurrent_config(arch, per_key=p.per_key)
        cfg = override(cfg, self.variant) if self.variant else cfg
        split = p.delta and cfg.splits_grad(64, 64)
        forward = (3 if p.delta else 2) - (p.delta and cfg.output_in_state)
        return forward + (3 if split else 2)


SPLIT, FUSED = "split_grad_from=0", "split_grad_from=none"
PER_PROGRAM = "chunks_per_program=4,chunks_per_program_from=0"
# forward + backward lowers every forward launch too (the custom_vjp's forward rule runs the same launches)
CASES = [
    Lowering("gdn_fwd_bwd", model_like("gdn")),
    Lowering("gla_fwd_bwd", model_like("gla")),
    Lowering("kda_fwd_bwd", model_like("kda")),
    Lowering("gdn_fwd_bwd_split_grad", model_like("gdn"), variant=SPLIT),
    Lowering("kda_fwd_bwd_split_grad", model_like("kda"), variant=SPLIT),
    Lowering("kda_chunk64_fwd_bwd_split_grad", model_like("kda", chunk=64), variant=SPLIT),
    Lowering("kda_chunk64_fwd_bwd_fused_grad", model_like("kda", chunk=64), variant=FUSED),
    Lowering("gdn_fwd_bwd_hdh_in_state_bwd", model_like("gdn"), variant="state_bwd_hdh_from=0"),
    Lowering("kda_fwd_bwd_split_grad_hdh_in_state_bwd", model_like("kda"), variant=f"{SPLIT},state_bwd_hdh_from=0"),
    Lowering("gdn_fwd_bwd_output_in_state", model_like("gdn"), variant="output_in_state=true"),
    Lowering("kda_fwd_bwd_split_grad_output_in_state", model_like("kda"), variant=f"{SPLIT},output_in_state=true"),
    Lowering("kda_fwd_bwd_split_grad_gate_sums_in_kernels", model_like("kda"),
             variant=f"{SPLIT},gate_cumsum_in_kernels=true"),
    Lowering("kda_fwd_bwd_fused_grad_gate_sums_in_kernels", model_like("kda"),
             variant=f"{FUSED},gate_cumsum_in_kernels=true"),
    Lowering("gdn_fwd_bwd_chunks_per_program", model_like("gdn", T=256), variant=PER_PROGRAM),
    Lowering("kda_fwd_bwd_split_grad_chunks_per_program", model_like("kda", T=256), variant=f"{SPLIT},{PER_PROGRAM}"),
    Lowering("gdn_fwd_bwd_segments", model_like("gdn"), segments=True),
    Lowering("gla_fwd_bwd_segments", model_like("gla"), segments=True),
    Lowering("gla_fwd_bwd_chunks_per_program_hdh_segments", model_like("gla", T=256),
             variant=f"{PER_PROGRAM},state_bwd_hdh_from=0", segments=True),
    Lowering("kda_fwd_bwd_split_grad_segments", model_like("kda"), variant=SPLIT, segments=True),
    Lowering("gdn_fwd_bwd_chunks_per_program_segments", model_like("gdn", T=256), variant=PER_PROGRAM,
             segments=True),
    Lowering("gdn_fwd_bwd_output_in_state_hdh_segments", model_like("gdn"),
             variant="output_in_state=true,state_bwd_hdh_from=0", segments=True),
    Lowering("attention_T300_qk48_v32_segments", Problem("attention", 2, 300, 4, 4, 48, 32), segments=True),
    Lowering("attention_T2048_qk64_v64", Problem("attention", 2, 2048, 4, 4, 64, 64)),
    Lowering("attention_T2048_qk128_v128", Problem("attention", 2, 2048, 4, 4, 128, 128)),
    Lowering("attention_T300_qk48_v32", Problem("attention", 2, 300, 4, 4, 48, 32)),
]


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lowers_to_triton(case: Lowering, arch: str):
    fn, args = kernel_case(case.problem, arch, case.variant, initial_state=case.problem.recurrent,
                           segments=case.segments)
    assert lower(fn, args, arch).count(TRITON_CALL) >= case.triton_calls(arch)


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("op", ["gdn", "kda", "gla"])
def test_context_parallel_shard_lowers_to_triton(arch: str, op: str):
    """A context shard's recurrence (``kernels/recurrent/context.py``, with packed documents): the plain launches, the
    delta rule's final-state-only pass and the start-gradient-only reverse pass, each under its own name."""
    p = model_like(op)
    specs = p.specs(initial_state=False, segments=True)
    names = list(specs)
    function = getattr(recurrence, {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "gla": "chunk_simple_gla"}[op])

    def loss(*xs):
        x = dict(zip(names, xs, strict=True))
        gates = (x["g"], x["beta"]) if p.delta else (x["g"],)
        o, _ = function(x["q"], x["k"], x["v"], *gates, axis=OneDevice(4), impl="pallas", segment_ids=x["segment_ids"])
        return o.astype(jnp.float32).sum()

    floats = tuple(i for i, n in enumerate(names) if n != "segment_ids")
    launches = {k.name for k in lowered_kernels(jax.grad(loss, argnums=floats), tuple(specs.values()), arch)}
    assert "state_bwd_start" in launches and {"state_fwd", "state_bwd"} <= launches
    assert ("state_fwd_final" in launches) == p.delta


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("use_bias, documents", [(True, True), (False, False)], ids=["bias_documents", "plain"])
def test_short_conv_backward_is_two_triton_calls(arch: str, use_bias: bool, documents: bool):
    """The short conv's gradient (K 4, T 300 and C 200: ragged tiles) is two Pallas launches (dpre with the weight
    sums, then dxp), for Mamba2's conv (a bias) with packed documents, unpadded and its output in three pieces, and
    for GDN's and KDA's (no bias) without."""
    B, T, C, K = 2, 300, 200, 4
    S = T if documents else K - 1 + T
    ids = jax.ShapeDtypeStruct((B, S), jnp.int32) if documents else None
    args = (jax.ShapeDtypeStruct((B, S, C), jnp.float32), jax.ShapeDtypeStruct((K, C), jnp.float32),
            jax.ShapeDtypeStruct((C,), jnp.float32) if use_bias else None, ids)

    def loss(xp, w, bias, ids):
        y = short_conv_silu(xp, w, bias, ids, out_dtype=jnp.bfloat16, impl="pallas", padded=not documents,
                            split=(64, 64, 72) if documents else None)
        return sum(p.astype(jnp.float32).sum() for p in (y if documents else [y]))

    assert lower(jax.grad(loss, argnums=(0, 1, 2)), args, arch).count(TRITON_CALL) == 2


@pytest.mark.parametrize("op, K, V, chunk, stages", [
    ("gdn", 64, 64, 64, (3, 3)),  # GDN at the 300M shape: its own entry (RECURRENT_AT_DIMS) fits 3 stages
    ("gla", 64, 64, 64, (3, 3)),  # Mamba2 at the hybrids' shape: its own entry, 3 stages at the 128-wide V tile
    ("gdn", 64, 128, 64, (2, 2)),  # the sm90 entry's 64-wide V tile at K 64: the bytes the H200 allocated
    ("kda", 128, 128, 16, (3, 3)),  # KDA at the anchor, its tuned chunk: unchanged
    ("kda", 128, 128, 64, (2, 2)),  # KDA at chunk 64: the 3-stage launches tuned at chunk 16 would overflow
])
def test_state_passes_fit_shared_memory(monkeypatch, op, K, V, chunk, stages):
    """The sequential kernels' stages are capped by shared memory, with a stage's bytes as Triton allocates them
    (benchmarks/NOTES.md: the H200's GDN state pass at the 300M shape allocated 2 stages of 24,832 bytes)."""
    calls = []

    def spy(launch, per_stage, shared_memory):
        fitted = fit_stages(launch, per_stage, shared_memory)
        calls.append((per_stage, fitted.num_stages))
        return fitted

    monkeypatch.setattr(recurrent_forward, "fit_stages", spy)
    monkeypatch.setattr(recurrent_backward, "fit_stages", spy)
    fn, args = kernel_case(Problem(op, 1, 128, 2, 2, K, V, chunk=chunk), "sm90")
    lower(fn, args, "sm90")
    assert [n for _, n in calls] == list(stages)  # state_fwd, then state_bwd
    if (op, V) == ("gdn", 128):
        assert calls[0][0] == 24_832
