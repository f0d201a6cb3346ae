"""The forward and backward launch stages (``kernels/recurrent/forward.py``, ``backward.py``) in their config's forms:
the output in the forward state pass, the gradient pass split in two launches, ``sum_v h dh`` from the reverse state
pass, the reverse pass's own V tile, and KDA's one-reference diagonal blocks with the levels launch that redoes the
rows they get wrong. Each form against the token-by-token recurrence and the chunked XLA form (interpret mode)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import recurrent, tuning
from hybrid_jax.kernels.tooling.calls import call
from tests.kernels.conftest import MILD, PALLAS, check, make_inputs, problem, rel_rms


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_split_gradient_pass(kind):
    """The gradient pass as two launches (``split_grad_from``) gives the same values and gradients."""
    p = problem(kind)
    config = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), split_grad_from=0)
    check(p, *make_inputs(p, 5), config=config)


@pytest.mark.parametrize("kind, split_grad_from", [("gdn", None), ("gdn", 0), ("gla", None), ("kda", None),
                                                   ("kda", 0)],
                         ids=["gdn-fused", "gdn-split", "gla", "kda-fused", "kda-split"])
def test_hdh_from_the_reverse_state_pass(kind, split_grad_from):
    """With ``state_bwd_hdh_from`` the reverse state pass computes the gradient pass's ``sum_v h dh`` (summed over
    two V tiles of 16): the same values and gradients (GLA's gradient pass is one launch either way)."""
    p = problem(kind, K=32, V=32)
    config = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), block_v=16, state_bwd_hdh_from=0,
                                 split_grad_from=split_grad_from)
    assert config.hdh_in_state_bwd(32, 32)
    check(p, *make_inputs(p, 16), config=config)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reverse_state_pass_with_its_own_value_tile(kind):
    """``block_v_bwd``: the reverse state pass in four V tiles of 16 while the forward's state pass has one of 64
    (``hdh`` summed over the four): the same values and gradients."""
    p = problem(kind, K=32, V=64)
    config = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), block_v=64, block_v_bwd=16,
                                 state_bwd_hdh_from=0)
    check(p, *make_inputs(p, 17), config=config)


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_output_in_the_state_pass(kind, chunk):
    """``output_in_state``: ``wy`` also stores ``P`` and the forward state pass, in two V tiles of 16, computes the
    output, so there is no output launch; the same values and gradients. KDA: the gate falls by 100 at row 20, so
    that ``wy``'s levels launch redoes ``P``'s far rows too."""
    p = problem(kind, T=45, K=32, V=32, chunk=chunk)
    x, ct = make_inputs(p, 21)
    if kind == "kda":
        x = dict(x, g=x["g"].at[:, 20].add(-100.0))
    base = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), block_v=16)
    config = dataclasses.replace(base, output_in_state=True)
    check(p, x, ct, config=config)
    program = lambda cfg: str(jax.make_jaxpr(lambda x: call(p, x, PALLAS, config=cfg))(x))  # noqa: E731
    assert "output_fwd" in program(base) and "output_fwd" not in program(config)


@pytest.mark.parametrize("kind", ["gla", "gdn", "kda"])
def test_backward_writes_what_xla_reads_in_the_inputs_dtype(kind):
    """bf16 inputs, two value heads per q/k head. The reverse state pass's ``d(v_new)``: without the delta rule (GLA)
    it is the op's ``dv``, written in v's dtype (no float32 copy for XLA to read and convert); with it the gradient
    pass reads it, in float32. The gradient pass's ``dq``, ``dk`` (per value head where XLA sums them, as FLA does)
    in q's dtype."""
    from hybrid_jax.kernels.recurrent import op

    p = problem(kind, T=32, dtype="bfloat16")
    x, (do, dfinal) = make_inputs(p, 4)

    def grads(x, do, dfinal):
        a = op.prepare(x["q"], x["k"], x["v"], x["g"], x.get("beta"), scale=None, initial_state=x["initial_state"],
                       use_qk_l2norm=False, chunk_size=16, interpret=True, config=None, segment_ids=None)
        _, _, res = op._forward(a.static, a.q, a.k, a.v, a.gamma, a.beta, a.h0, a.rel)
        dh, dv_new, _, hdh = recurrent.state_bwd(a.static, res, do, dfinal)
        return dv_new, recurrent.grad(a.static, res, dh, hdh, dv_new if kind != "gla" else None, do)[:2]

    dv_new, (dq, dk) = jax.eval_shape(grads, x, do, dfinal)
    assert dv_new.shape == x["v"].shape and dv_new.dtype == (jnp.bfloat16 if kind == "gla" else jnp.float32)
    heads = x["q"].shape[2] if kind == "gla" else x["v"].shape[2]  # GLA's gradient pass sums over the value heads
    for d in (dq, dk):
        assert d.shape == (*x["q"].shape[:2], heads, x["q"].shape[3]) and d.dtype == jnp.bfloat16


def kda_stages(seed: int, fall_rows: tuple[int, ...], T: int, levels_chunks: int):
    """A KDA problem at chunk 16 (``T / 16`` chunks of one 16-row block) whose gate falls by 100 at each of
    ``fall_rows``, and every stage's static and arguments: ``wy``, ``wy_p`` (``wy`` also storing the output's ``P``),
    ``output``, ``grad``, and ``grad_hdh`` (the gradient pass with ``sum_v h dh`` from the reverse state pass). The
    gate is mild elsewhere (``MILD``), so that only the chunks of ``fall_rows`` need the fallback."""
    p = problem("kda", B=1, T=T)
    x, (do, dfinal) = make_inputs(p, seed, dt_range=MILD)
    q, k, v, beta, h0 = x["q"], x["k"], x["v"], x["beta"], x["initial_state"]
    g = x["g"]
    for row in fall_rows:
        g = g.at[:, row].add(-100.0)
    cfg = dataclasses.replace(tuning.recurrent_config(per_key=True), levels_chunks=levels_chunks,
                              state_bwd_hdh_from=None)
    static = recurrent.Static(0.25, 16, cfg, True)
    gamma = recurrent.chunk_local_cumsum(g, 16)
    u, w, t = recurrent.wy(static, k, v, gamma, beta)
    h, v_new, _ = recurrent.state_fwd(static, k, gamma, w, u, h0)
    _, p_out = recurrent.output(static, q, k, v_new, gamma, h)
    res = recurrent.Residuals(q, k, v, gamma, beta, w, t, h, v_new, p_out, None, q, k)
    args = {"wy": (k, v, gamma, beta), "wy_p": (k, v, gamma, beta, q), "output": (q, k, v_new, gamma, h)}
    statics = dict.fromkeys(args, static)
    for name, hdh_from in (("grad", None), ("grad_hdh", 0)):
        statics[name] = dataclasses.replace(static, cfg=dataclasses.replace(cfg, state_bwd_hdh_from=hdh_from))
        dh, dv_new, _, hdh = recurrent.state_bwd(statics[name], res, do, dfinal)
        assert (hdh is not None) == (hdh_from is not None)
        args[name] = (res, dh, hdh, dv_new, do)
    return statics, args


@pytest.mark.parametrize("T, fall_rows, levels_chunks", [(48, (20,), 8), (64, (5, 36), 4), (64, (36,), 2)],
                         ids=["one-chunk-per-program", "four-chunks-per-program", "two-chunks-per-program"])
def test_kda_one_reference_passes_and_their_fallback(T, fall_rows, levels_chunks):
    """Each KDA kernel with diagonal blocks (``wy``, ``wy_p``, ``output``, ``grad``, ``grad_hdh``) runs first around
    one reference row per block, then, in the chunks where the gate falls by 100 at a row, with the levels, which
    rewrite the far rows in place: in the forward that row and the later ones of its chunk (a row's choice reads no
    later gate), in the gradient pass the whole block. The far rows are the levels' bit for bit (the one-reference
    form is wrong there), the others the one-reference form's, which really differs from the levels' in rounding.
    The levels launch takes 1 (three chunks), 4 or 2 chunks per program (``levels_chunks``). Values and gradients of
    the whole recurrence on such a gate: ``test_op.py::test_kda_one_reference_fallback_end_to_end``."""
    statics, args = kda_stages(17, fall_rows, T, levels_chunks)
    launches = {"wy": recurrent.wy, "wy_p": recurrent.wy, "output": recurrent.output, "grad": recurrent.grad,
                "grad_hdh": recurrent.grad}
    for stage, launch in launches.items():
        st = statics[stage]
        mixed, fast = (launch(st, *args[stage], redo_far=redo) for redo in (True, False))
        levels = launch(dataclasses.replace(st, cfg=dataclasses.replace(st.cfg, one_reference_span=0)), *args[stage])
        far = np.zeros(T, bool)
        for row in fall_rows:  # the rest of its chunk (16 rows, one block); in the gradient pass all of it
            far[(row if not stage.startswith("grad") else row - row % 16):row - row % 16 + 16] = True
        for x, y, z in zip(mixed, fast, levels, strict=True):
            x, y, z = (np.asarray(a) for a in (x, y, z))
            assert np.all(np.isfinite(x)), stage
            np.testing.assert_array_equal(x[:, far], z[:, far], err_msg=stage)
            np.testing.assert_array_equal(x[:, ~far], y[:, ~far], err_msg=stage)
        assert max(rel_rms(np.asarray(y)[:, far], np.asarray(z)[:, far])
                   for y, z in zip(fast, levels, strict=True)) > 1e-2, stage
        mild = [(np.asarray(y)[:, ~far], np.asarray(z)[:, ~far]) for y, z in zip(fast, levels, strict=True)]
        assert not all(np.array_equal(y, z) for y, z in mild), stage
