"""Pallas chunked GDN / KDA / GLA kernels (interpret mode on CPU) against the naive recurrence and the XLA form."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from hybrid_jax.kernels import api, recurrent, reference, tuning
from hybrid_jax.kernels.recurrent import block_math, chunk_recurrence, op
from hybrid_jax.kernels.recurrent.launch import far_chunks, over_chunks
from tests.conftest import jaxpr_equations

ARGS = ("q", "k", "v", "g", "beta", "h0")


def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def make_inputs(seed, *, B=2, T=37, H=1, HV=2, K=16, V=32, dtype=jnp.float32, delta=True, init=True, g_min=None,
                per_key=False):
    """Random inputs; ``per_key``: a KDA gate ``[B,T,HV,K]`` instead of ``[B,T,HV]``."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    g_shape = (B, T, HV, K) if per_key else (B, T, HV)
    q = jax.random.normal(ks[0], (B, T, H, K)).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, H, K)).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, HV, V)).astype(dtype)
    if g_min is None:
        g = jax.nn.log_sigmoid(jax.random.normal(ks[3], g_shape) + 2.0)
    else:  # strongly negative gates, down to g_min per step
        g = jax.random.uniform(ks[3], g_shape, minval=g_min, maxval=0.0).at[:, ::3].set(g_min)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV))).astype(dtype) if delta else None
    h0 = jax.random.normal(ks[5], (B, HV, K, V)) if init else None
    w_o = jax.random.normal(ks[6], (B, T, HV, V))
    w_h = jax.random.normal(ks[7], (B, HV, K, V))
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0), (w_o, w_h)


def value_and_grads(fn, inputs, weights, *, final_state: bool):
    """Loss = <o, w_o> (+ <final, w_h>); returns (o, final, {name: grad}) for every non-None input."""
    names = [n for n in ARGS if inputs[n] is not None]
    w_o, w_h = weights

    def loss(*xs):
        kw = dict(inputs, **dict(zip(names, xs, strict=True)))
        o, ht = fn(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], initial_state=kw["h0"])
        val = jnp.sum(o.astype(jnp.float32) * w_o)
        if final_state:
            val = val + jnp.sum(ht * w_h)
        return val, (o, ht)

    (_, (o, ht)), grads = jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
        *[inputs[n] for n in names]
    )
    return o, ht, dict(zip(names, grads, strict=True))


def pallas(chunk, config=None):
    return lambda q, k, v, g, beta, **kw: chunk_recurrence(
        q, k, v, g, beta, use_qk_l2norm=True, chunk_size=chunk, interpret=True, config=config, **kw
    )


def naive(q, k, v, g, beta, **kw):
    return reference.naive_recurrence(*(x if x is None else x.astype(jnp.float32) for x in (q, k, v, g, beta)),
                                      use_qk_l2norm=True, **kw)


def xla(chunk):
    return lambda q, k, v, g, beta, **kw: reference.chunked_recurrence(
        q, k, v, g, beta, use_qk_l2norm=True, chunk_size=chunk, **kw
    )


def check(inputs, weights, *, chunk, final_state, fwd_tol, grad_tol, against_xla=True, config=None):
    o, ht, grads = value_and_grads(pallas(chunk, config), inputs, weights, final_state=final_state)
    refs = [naive] + ([xla(chunk)] if against_xla else [])
    for ref_fn in refs:
        o_r, ht_r, grads_r = value_and_grads(ref_fn, inputs, weights, final_state=final_state)
        assert o.dtype == inputs["v"].dtype and o.shape == o_r.shape
        assert rel_rms(o, o_r) <= fwd_tol
        if final_state:
            assert rel_rms(ht, ht_r) <= fwd_tol
        assert set(grads) == set(grads_r)
        for name, grad in grads.items():
            assert grad.shape == inputs[name].shape and grad.dtype == inputs[name].dtype, name
            assert np.all(np.isfinite(np.asarray(grad, np.float32))), name
            assert rel_rms(grad, grads_r[name]) <= grad_tol, (name, rel_rms(grad, grads_r[name]))


@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "gla"])
def test_float32_ragged_grouped_with_states(delta):
    inputs, weights = make_inputs(0, T=37, delta=delta)
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=1e-4, grad_tol=1e-4)


@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "gla"])
def test_float32_shorter_than_chunk_no_states(delta):
    inputs, weights = make_inputs(1, B=1, T=11, H=2, HV=2, delta=delta, init=False)
    check(inputs, weights, chunk=16, final_state=False, fwd_tol=1e-4, grad_tol=1e-4)


def test_float32_chunk32_wide_keys():
    """Chunk 32 (three levels of the block-doubling inverse), K > V, T a multiple of the chunk."""
    inputs, weights = make_inputs(2, B=1, T=64, H=1, HV=2, K=32, V=16)
    check(inputs, weights, chunk=32, final_state=True, fwd_tol=1e-4, grad_tol=1e-4)


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_split_gradient_pass(per_key):
    """The gradient pass as two launches (``split_grad_from``) gives the same values and gradients."""
    inputs, weights = make_inputs(5, T=37, per_key=per_key)
    config = dataclasses.replace(tuning.recurrent_config(per_key=per_key), split_grad_from=0)
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=1e-4, grad_tol=1e-4, config=config)


@pytest.mark.parametrize("split_grad_from", [None, 0], ids=["fused", "split"])
@pytest.mark.parametrize("kind", ["gdn", "gla", "kda"])
def test_hdh_from_the_reverse_state_pass(kind, split_grad_from):
    """With ``state_bwd_hdh_from`` the reverse state pass computes the gradient pass's ``sum_v h dh`` (summed over
    two V tiles of 16): the same values and gradients."""
    per_key = kind == "kda"
    inputs, weights = make_inputs(16, T=37, K=32, V=32, delta=kind != "gla", per_key=per_key)
    config = dataclasses.replace(tuning.recurrent_config(per_key=per_key), block_v=16, state_bwd_hdh_from=0,
                                 split_grad_from=split_grad_from)
    assert config.hdh_in_state_bwd(32, 32)
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=1e-4, grad_tol=1e-4, config=config)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reverse_state_pass_with_its_own_value_tile(kind):
    """``block_v_bwd``: the reverse state pass in four V tiles of 16 while the forward's state pass has one of 64
    (``hdh`` summed over the four): the same values and gradients."""
    per_key = kind == "kda"
    inputs, weights = make_inputs(17, T=37, K=32, V=64, delta=True, per_key=per_key)
    config = dataclasses.replace(tuning.recurrent_config(per_key=per_key), block_v=64, block_v_bwd=16,
                                 state_bwd_hdh_from=0)
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=1e-4, grad_tol=1e-4, config=config)


@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "gla"])
def test_bfloat16(delta):
    inputs, weights = make_inputs(3, T=37, dtype=jnp.bfloat16, delta=delta)
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=5e-3, grad_tol=2e-2, against_xla=False)


@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "gla"])
def test_strongly_negative_gates(delta):
    inputs, weights = make_inputs(4, T=40, delta=delta, g_min=-20.0)
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=1e-4, grad_tol=1e-4)


def test_api_dispatch():
    inputs, _ = make_inputs(5, B=1, T=20)
    q, k, v, g, beta, h0 = (inputs[n] for n in ARGS)
    o, ht = api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm=True, chunk_size=16, impl="pallas_interpret")
    o_x, ht_x = api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm=True, chunk_size=16, impl="xla")
    assert rel_rms(o, o_x) <= 1e-4 and rel_rms(ht, ht_x) <= 1e-4
    o, ht = api.chunk_simple_gla(q, k, v, g, chunk_size=16, impl="pallas_interpret")
    o_x, _ = api.chunk_simple_gla(q, k, v, g, chunk_size=16, impl="xla")
    assert ht is None and rel_rms(o, o_x) <= 1e-4
    g_k = jnp.repeat(g[..., None], q.shape[-1], -1) * jnp.linspace(0.5, 1.5, q.shape[-1])
    o, _ = api.chunk_kda(q, k, v, g_k, beta, use_qk_l2norm=True, chunk_size=16, impl="pallas_interpret")
    o_x, _ = api.chunk_kda(q, k, v, g_k, beta, use_qk_l2norm=True, chunk_size=16, impl="xla")
    assert rel_rms(o, o_x) <= 1e-4


# KDA (per-key gate): chunk 32 = two sub-chunks of 16, so both the factored off-diagonal blocks and the exact
# diagonal blocks are exercised.


def jaxpr_text(fn, *args) -> str:
    """The jaxpr of ``fn(*args)`` as text (it names each ``pallas_call``'s kernel)."""
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_output_in_the_state_pass(kind, chunk):
    """``output_in_state``: ``wy`` also stores ``P`` and the forward state pass, in two V tiles of 16, computes the
    output, so there is no output launch; the same values and gradients. KDA: the gate falls by 100 at row 20, so
    that ``wy``'s levels launch redoes ``P``'s far rows too."""
    per_key = kind == "kda"
    inputs, weights = make_inputs(21, T=45, K=32, V=32, per_key=per_key)
    if per_key:
        inputs["g"] = inputs["g"].at[:, 20].add(-100.0)
    base = dataclasses.replace(tuning.recurrent_config(per_key=per_key), block_v=16)
    config = dataclasses.replace(base, output_in_state=True)
    check(inputs, weights, chunk=chunk, final_state=True, fwd_tol=1e-4, grad_tol=1e-4, config=config)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    assert "output_fwd" in jaxpr_text(pallas(chunk, base), *args)
    assert "output_fwd" not in jaxpr_text(pallas(chunk, config), *args)


@pytest.mark.parametrize("case", ["steep-fused", "falling-split", "with-output-in-state"])
def test_kda_gate_sums_in_kernels(case, monkeypatch):
    """``gate_cumsum_in_kernels``: the kernels take the raw gate, sum each chunk themselves and return the raw gate's
    gradient: the same values and gradients. Gates down to -20 per step with -1000 entries (fused gradient pass); a
    gate falling by 100 at row 20, so that the levels launches redo a chunk (split gradient pass: the reverse sum
    in the second launch); and with the output computed in the forward state pass. XLA's chunk cumsum is not called."""
    inputs, weights = make_inputs(22, B=1, T=37, K=16, V=16, per_key=True,
                                  g_min=-20.0 if case == "steep-fused" else None)
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), gate_cumsum_in_kernels=True,
                                 split_grad_from=None if case == "steep-fused" else 0)
    if case == "steep-fused":
        inputs["g"] = inputs["g"].at[:, 5::11, :, ::3].set(-1000.0)
    else:
        inputs["g"] = inputs["g"].at[:, 20].add(-100.0)
        config = dataclasses.replace(config, output_in_state=case == "with-output-in-state")
    check(inputs, weights, chunk=16, final_state=True, fwd_tol=1e-4, grad_tol=1e-4, config=config)

    def xla_cumsum(*_):
        raise AssertionError("XLA's chunk cumsum was called")

    monkeypatch.setattr(op, "chunk_local_cumsum", xla_cumsum)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    jaxpr_text(pallas(16, config), *args)
    with pytest.raises(AssertionError, match="chunk cumsum"):  # without the option it is called
        jaxpr_text(pallas(16, dataclasses.replace(config, gate_cumsum_in_kernels=False)), *args)


def test_kda_gate_sums_in_kernels_flags_and_chunk():
    """Where the kernels sum the gate, XLA flags the chunks for the levels launches from the raw gate: the same
    chunks as from the cumulated gate for a gate <= 0, and at least those for a gate of either sign; at chunks
    other than 16 XLA sums the gate, as without the option."""
    g = jax.random.uniform(jax.random.PRNGKey(23), (2, 64, 3, 32), minval=-0.5, maxval=0.0)
    g = g.at[0, 16:32, 1, 3].set(-1.0).at[1, 40:48, 2, 20].set(-2.0)  # two chunks move by 15 and 16 in one channel
    for gate in (g, g.at[:, 1::2].multiply(-1.0)):
        cumulated = far_chunks(recurrent.chunk_local_cumsum(gate, 16), 8.0, 16)
        raw = far_chunks(gate, 8.0, 16, cumulated=False)
        assert np.all(np.asarray(raw) >= np.asarray(cumulated))
        if gate is g:
            assert float(cumulated.sum()) == 2  # the two steep chunks
            np.testing.assert_array_equal(np.asarray(raw), np.asarray(cumulated))
        else:  # rows of alternating sign cancel in the sums, not in the bound
            assert float(raw.sum()) > float(cumulated.sum())
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), gate_cumsum_in_kernels=True)
    assert recurrent.kernel_gate(g, 16, config) is g
    np.testing.assert_array_equal(np.asarray(recurrent.kernel_gate(g, 32, config)),  # other chunks: XLA sums
                                  np.asarray(recurrent.chunk_local_cumsum(g, 32)))
    scalar = g[..., 0]  # the scalar gate keeps XLA's cumsum
    np.testing.assert_array_equal(np.asarray(recurrent.kernel_gate(scalar, 32, config)),
                                  np.asarray(recurrent.chunk_local_cumsum(scalar, 32)))


def test_kda_gate_sums_option_at_another_chunk():
    """A config with ``gate_cumsum_in_kernels`` (as the sm90 KDA table has) at a chunk the caller picks other than
    16: XLA sums the gate, and values and gradients are right."""
    inputs, weights = make_inputs(24, B=1, T=37, K=16, V=16, per_key=True)
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), gate_cumsum_in_kernels=True,
                                 output_in_state=True)
    check(inputs, weights, chunk=32, final_state=True, fwd_tol=1e-4, grad_tol=1e-4, config=config)


def test_kda_float32_ragged_grouped_with_states():
    inputs, weights = make_inputs(10, B=1, T=45, per_key=True)
    check(inputs, weights, chunk=32, final_state=True, fwd_tol=1e-4, grad_tol=1e-4)


def test_kda_float32_shorter_than_chunk_no_states():
    inputs, weights = make_inputs(11, B=1, T=11, H=2, HV=2, init=False, per_key=True)
    check(inputs, weights, chunk=16, final_state=False, fwd_tol=1e-4, grad_tol=1e-4)


def test_kda_bfloat16():
    inputs, weights = make_inputs(12, B=1, T=45, dtype=jnp.bfloat16, per_key=True)
    check(inputs, weights, chunk=32, final_state=True, fwd_tol=5e-3, grad_tol=2e-2, against_xla=False)


@pytest.mark.parametrize("chunk", [32, 64])
def test_kda_strongly_negative_gates(chunk):
    """Gates down to -20 per step and per channel (a span of 640 in a chunk of 32), and -1000 on some (step,
    channel) pairs as in FLA's stress test: no overflow or NaN, same values and gradients. Chunk 64: four 16-row
    blocks, pairs up to three blocks apart."""
    inputs, weights = make_inputs(13, B=1, T=40 if chunk == 32 else 72, per_key=True, g_min=-20.0)
    inputs["g"] = inputs["g"].at[:, 5::11, :, ::3].set(-1000.0)
    check(inputs, weights, chunk=chunk, final_state=True, fwd_tol=1e-4, grad_tol=1e-4)


@pytest.mark.parametrize("chunk, options", [(32, {}), (32, {"output_in_state": True}),
                                           (16, {"output_in_state": True, "gate_cumsum_in_kernels": True})],
                         ids=["output-launch", "output-in-state", "gate-sums-in-kernels"])
def test_kda_outputs_do_not_depend_on_later_gates(chunk, options):
    """o[:, :t+1] is bit-identical when every gate after t changes (within t's sub-chunk, chunk and later); also with
    the output computed in the forward state pass, and with the gate summed in the kernels."""
    inputs, _ = make_inputs(14, B=1, T=40, per_key=True)
    q, k, v, g, beta, h0 = (inputs[n] for n in ARGS)
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), **options)
    fn = jax.jit(lambda g: pallas(chunk, config)(q, k, v, g, beta, initial_state=h0)[0])
    t = 20  # row 4 of the second sub-chunk (at chunk 16: chunk) of the first chunk
    g_later = jax.random.uniform(jax.random.PRNGKey(15), g.shape, minval=-30.0, maxval=0.0)
    o, o_p = fn(g), fn(g.at[:, t + 1:].set(g_later[:, t + 1:]))
    np.testing.assert_array_equal(np.asarray(o[:, : t + 1]), np.asarray(o_p[:, : t + 1]))
    assert rel_rms(o_p[:, t + 1:], o[:, t + 1:]) > 1e-2  # the later outputs do see the change


def exact_gram(a, b, gam, strict: bool) -> np.ndarray:
    """``G_ij = sum_d a_id b_jd exp(gamma_id - gamma_jd)`` on the (strict) lower triangle, in float64."""
    a, b, gam = (np.asarray(x, np.float64) for x in (a, b, gam))
    g = np.einsum("id,jd,ijd->ij", a, b, np.exp(np.minimum(gam[:, None, :] - gam[None, :, :], 0.0)))
    return np.tril(g, -1 if strict else 0)


@pytest.mark.parametrize("strict", [True, False])
def test_kda_one_reference_diagonal_products(strict):
    """A diagonal block's products around one reference row (``span > 0``) are exact on a mild gate and on the rows
    before a fall of 100 at row 8, finite on every row (the factors are capped), wrong after the fall (the rows the
    fallback redoes); with ``span = 0`` the levels are exact everywhere, and the one-reference form is really
    another computation (its rounding differs)."""
    ks = jax.random.split(jax.random.PRNGKey(16), 3)
    a, b = (jax.random.normal(key, (16, 32)) for key in ks[:2])
    step = -jax.random.uniform(ks[2], (16, 32), maxval=0.3)
    mild = jnp.cumsum(step, axis=0)
    fallen = mild.at[8:].add(-100.0)
    gram = jax.jit(lambda gam, span: block_math.block_gram([a], [b], [gam], strict, span)[0][0], static_argnums=1)
    for gam in (mild, fallen):
        levels = np.asarray(gram(gam, 0.0))
        assert rel_rms(levels, exact_gram(a, b, gam, strict)) <= 1e-6
    assert rel_rms(gram(mild, 32.0), exact_gram(a, b, mild, strict)) <= 1e-6
    g = np.asarray(gram(fallen, 32.0))
    exact = exact_gram(a, b, fallen, strict)
    assert np.all(np.isfinite(g))
    assert rel_rms(g[:8], exact[:8]) <= 1e-6 and rel_rms(g[8:], exact[8:]) > 1e-2
    assert not np.array_equal(np.asarray(gram(mild, 32.0)), np.asarray(gram(mild, 0.0)))


def launch_grids(fn, *args) -> dict[str, tuple[int, ...]]:
    """The grid of each ``pallas_call`` in ``fn(*args)``'s jaxpr (nested ones included), by kernel name."""
    return {str(eqn.params["name"]): tuple(eqn.params["grid_mapping"].grid)
            for eqn in jaxpr_equations(jax.make_jaxpr(fn)(*args).jaxpr) if eqn.primitive.name == "pallas_call"}


@pytest.mark.parametrize("kind, T, split, options", [
    ("gdn", 120, None, {}), ("gla", 64, None, {}), ("kda", 96, 0, {}), ("kda", 64, None, {"output_in_state": True}),
], ids=["gdn-fused", "gla", "kda-split-six-chunks", "kda-fused-output-in-state"])
def test_chunks_per_program(kind, T, split, options):
    """``chunks_per_program=4``: each program of the chunk-parallel launches (``wy``, ``output``, ``grad``,
    ``grad_wy``) loops over 4 consecutive chunks of 16 (2 where there are 6), and values and gradients are the one-chunk
    programs' to float32 rounding (on the CPU XLA may round a loop's float32 sums differently). KDA: the gate falls
    by 100 at row 20, so that the levels launches redo a chunk too."""
    per_key, delta = kind == "kda", kind != "gla"
    inputs, weights = make_inputs(31, B=1, T=T, K=32, V=32, per_key=per_key, delta=delta)
    if per_key:
        inputs["g"] = inputs["g"].at[:, 20].add(-100.0)
    one = dataclasses.replace(tuning.recurrent_config(per_key=per_key), split_grad_from=split, **options)
    looped = dataclasses.replace(one, chunks_per_program=4, chunks_per_program_from=0)
    N = -(-T // 16)
    per_program = math.gcd(N, 4)

    def grids(config):
        fn = pallas(16, config)
        loss = lambda *xs: jnp.sum(fn(*xs, initial_state=inputs["h0"])[0])
        return launch_grids(jax.grad(loss, argnums=(0, 1, 2, 3)), *(inputs[n] for n in ("q", "k", "v", "g", "beta")))

    chunk_parallel = {"wy_fwd", "output_fwd", "grad_bwd", "grad_wy_bwd"}
    one_grids, looped_grids = grids(one), grids(looped)
    assert set(one_grids) == set(looped_grids) and {"grad_bwd"} <= set(one_grids)
    assert ("grad_wy_bwd" in one_grids) == (split == 0)
    assert ("output_fwd" in one_grids) != options.get("output_in_state", False)
    for name, grid in one_grids.items():  # the chunk-parallel launches: N programs per head, then N / per_program
        want = grid[:2] + (N // per_program,) if name in chunk_parallel else grid
        assert name not in chunk_parallel or grid[:3] == (1, 2, N), (name, grid)
        assert looped_grids[name] == want, (name, grid, looped_grids[name])
    assert len(looped_grids["grad_bwd"]) == 3
    expected, got = (jax.tree.leaves(value_and_grads(pallas(16, c), inputs, weights, final_state=True))
                     for c in (one, looped))
    assert len(got) == len(expected) == 2 + len([n for n in ARGS if inputs[n] is not None])
    for a, b in zip(expected, got, strict=True):
        assert rel_rms(b, a) <= 1e-5, rel_rms(b, a)


def test_chunks_per_program_rule():
    """The loop applies where the padded ``K * V`` reaches ``chunks_per_program_from`` (``None``: never); the sm90 KDA
    table loops at K = V = 128 only (slower at K = 32, V = 64), its GDN table not at all (slower at its anchor)."""
    rule = tuning.RecurrentConfig(chunks_per_program=4, chunks_per_program_from=128 * 128)
    assert rule.chunks_per_program_at(128, 128) == 4
    assert rule.chunks_per_program_at(32, 64) == 1
    assert dataclasses.replace(rule, chunks_per_program_from=None).chunks_per_program_at(128, 128) == 1
    assert dataclasses.replace(rule, chunks_per_program_from=0).chunks_per_program_at(32, 64) == 4
    kda = tuning.recurrent_config("sm90", per_key=True)
    assert (kda.chunks_per_program_at(128, 128), kda.chunks_per_program_at(32, 64)) == (4, 1)
    assert tuning.recurrent_config("sm90").chunks_per_program_at(128, 128) == 1


def kda_stage_inputs(seed: int, fall_rows: tuple[int, ...], T: int = 48, levels_chunks: int = 8,
                     want_hdh: bool = False):
    """A KDA case at chunk 16 (``T / 16`` chunks of one 16-row block) whose mild gate falls by 100 at each of
    ``fall_rows``, and the arguments of every stage: ``(static, {stage: args})``. ``want_hdh``: the gradient pass takes
    ``sum_v h dh`` from the reverse state pass (``state_bwd_hdh_from``)."""
    inputs, weights = make_inputs(seed, B=1, T=T, per_key=True)
    for row in fall_rows:
        inputs["g"] = inputs["g"].at[:, row].add(-100.0)
    q, k, v, g, beta, h0 = (inputs[n] for n in ARGS)
    cfg = dataclasses.replace(tuning.recurrent_config(per_key=True), levels_chunks=levels_chunks,
                              state_bwd_hdh_from=0 if want_hdh else None)
    static = recurrent.Static(0.25, 16, cfg, True)
    gamma = recurrent.chunk_local_cumsum(g, 16)
    u, w, t = recurrent.wy(static, k, v, gamma, beta)
    h, v_new, _ = recurrent.state_fwd(static, k, gamma, w, u, h0)
    _, p = recurrent.output(static, q, k, v_new, gamma, h)
    do = weights[0].astype(v.dtype)
    res = recurrent.Residuals(q, k, v, gamma, beta, w, t, h, v_new, p, None, q, k)
    dh, dv_new, _, hdh = recurrent.state_bwd(static, res, do, weights[1])
    assert (hdh is not None) == want_hdh
    return static, {"wy": (k, v, gamma, beta), "wy_p": (k, v, gamma, beta, q), "output": (q, k, v_new, gamma, h),
                    "grad": (res, dh, hdh, dv_new, do)}


@pytest.mark.parametrize("T, fall_rows, levels_chunks", [(48, (20,), 8), (64, (5, 36), 4), (64, (36,), 2)],
                         ids=["one-chunk-per-program", "four-chunks-per-program", "two-chunks-per-program"])
@pytest.mark.parametrize("stage", ["wy", "wy_p", "output", "grad", "grad_hdh"])
def test_kda_one_reference_passes_and_their_fallback(stage, T, fall_rows, levels_chunks):
    """Each KDA kernel with diagonal blocks runs first around one reference row per block, then, in the chunks where
    the gate falls by 100 at a row, with the levels, which rewrite the far rows in place: in the forward that row and
    the later ones of its chunk (a row's choice reads no later gate), in the gradient pass the whole block. The far
    rows are the levels' bit for bit (the one-reference form is wrong there), the others the one-reference form's,
    which really differs from the levels' in rounding. The levels launch takes 1 (three chunks), 4 or 2 chunks per
    program (``levels_chunks``); ``grad_hdh``: the gradient pass with ``sum_v h dh`` as an input (from the reverse
    state pass); ``wy_p``: ``wy`` also storing the output's ``P`` (``output_in_state``). Values and gradients of the
    whole recurrence on such a gate: ``test_kda_one_reference_fallback_end_to_end``."""
    st, args = kda_stage_inputs(17, fall_rows, T, levels_chunks, want_hdh=stage == "grad_hdh")
    stage = stage.removesuffix("_hdh")
    launch = {"wy": recurrent.wy, "wy_p": recurrent.wy, "output": recurrent.output, "grad": recurrent.grad}[stage]
    mixed, fast = (launch(st, *args[stage], redo_far=redo) for redo in (True, False))
    st_levels = dataclasses.replace(st, cfg=dataclasses.replace(st.cfg, one_reference_span=0))
    levels = launch(st_levels, *args[stage])
    far = np.zeros(T, bool)
    for row in fall_rows:  # the rest of its chunk (16 rows, one block); in the gradient pass all of it
        far[(row if stage != "grad" else row - row % 16):row - row % 16 + 16] = True
    for x, y, z in zip(mixed, fast, levels, strict=True):
        x, y, z = (np.asarray(a) for a in (x, y, z))
        assert np.all(np.isfinite(x))
        np.testing.assert_array_equal(x[:, far], z[:, far])
        np.testing.assert_array_equal(x[:, ~far], y[:, ~far])
    assert max(rel_rms(np.asarray(y)[:, far], np.asarray(z)[:, far]) for y, z in zip(fast, levels, strict=True)) > 1e-2
    mild = [(np.asarray(y)[:, ~far], np.asarray(z)[:, ~far]) for y, z in zip(fast, levels, strict=True)]
    assert not all(np.array_equal(y, z) for y, z in mild)


def test_levels_launch_spans_chunks_on_axis_1_only():
    """The levels launch widens each chunk-parallel BlockSpec to several chunks along axis 1 (``C`` rows, or one
    squeezed per-chunk entry such as a state snapshot); a spec that follows the chunk on another axis is an error,
    not a silently wrong block."""
    rows = pl.BlockSpec((None, 16, None, 32), lambda b, h, c: (b, c, h // 2, 0))
    snap = pl.BlockSpec((None, None, None, 32, 64), lambda b, h, c: (b, c, h, 0, 0))
    assert over_chunks(rows, 4).block_shape == (None, 64, None, 32)
    assert over_chunks(snap, 4).block_shape == (None, 4, None, 32, 64)
    per_head_first = pl.BlockSpec((None, None, None, 32), lambda b, h, c: (b, h, c, 0))
    with pytest.raises(ValueError, match="axis 1"):
        over_chunks(per_head_first, 4)


@pytest.mark.parametrize("chunk, fall_row", [(16, 20), (32, 8)])
def test_kda_one_reference_fallback_end_to_end(chunk, fall_row):
    """Values and gradients against the naive recurrence on a mild gate that falls by 100 at one row (every launch's
    fallback runs). Chunk 32, row 8: the first of two blocks falls, and the second block's rows, though their own
    gate is mild, must be redone too, as ``T`` carries the first block's wrong rows into them."""
    inputs, weights = make_inputs(17, B=1, T=48, per_key=True)
    inputs["g"] = inputs["g"].at[:, fall_row].add(-100.0)
    check(inputs, weights, chunk=chunk, final_state=True, fwd_tol=1e-4, grad_tol=1e-4)


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("per_key", [False, True], ids=["scalar", "per-key"])
def test_chunk_local_cumsum_and_its_vjp(per_key, chunk):
    """The gate's cumulative sum restarts at every chunk; its VJP is the reverse cumulative sum per chunk (a per-key
    gate's chunk of 32 or 64 is summed in blocks of 16 and offset by the earlier blocks' totals)."""
    g = jax.random.normal(jax.random.PRNGKey(20), (2, 192, 3, 8) if per_key else (2, 192, 3))
    ct = jax.random.normal(jax.random.PRNGKey(21), g.shape)
    out, vjp = jax.vjp(lambda x: recurrent.chunk_local_cumsum(x, chunk), g)
    chunks = np.asarray(g).reshape(2, 192 // chunk, chunk, *g.shape[2:])
    np.testing.assert_allclose(out, np.cumsum(chunks, axis=2).reshape(g.shape), rtol=1e-6, atol=1e-5)
    rev = np.flip(np.cumsum(np.flip(np.asarray(ct).reshape(chunks.shape), 2), axis=2), 2)
    np.testing.assert_allclose(vjp(ct)[0], rev.reshape(g.shape), rtol=1e-6, atol=1e-5)
    t = chunk + 20  # the second chunk's row 20: its sum reads no later row, to the bit
    later = jax.jit(lambda x: recurrent.chunk_local_cumsum(x, chunk))(g.at[:, t + 1:].multiply(1e3))
    np.testing.assert_array_equal(np.asarray(later[:, : t + 1]), np.asarray(out[:, : t + 1]))


def test_rejects_bad_chunk_size():
    inputs, _ = make_inputs(6, B=1, T=8)
    with pytest.raises(ValueError, match="power of two"):
        chunk_recurrence(*(inputs[n] for n in ARGS[:5]), chunk_size=24, interpret=True)


@pytest.mark.parametrize("per_key", [False, True])
def test_chunk_size_none_takes_the_configs_chunk(per_key):
    """``chunk_size=None`` runs at ``config.chunk`` (bit-identical to passing it), and the default config is the
    gate kind's table entry: chunk 64 for GDN/GLA, 16 for KDA."""
    inputs, _ = make_inputs(16, B=1, T=40, per_key=per_key)
    x = [inputs[n] for n in ARGS[:5]]
    run = lambda **kw: chunk_recurrence(*x, use_qk_l2norm=True, interpret=True, **kw)[0]
    cfg = tuning.RecurrentConfig(chunk=32)
    np.testing.assert_array_equal(np.asarray(run(config=cfg)), np.asarray(run(config=cfg, chunk_size=32)))
    assert rel_rms(run(config=cfg), run(config=cfg, chunk_size=16)) > 0  # the chunk does change the rounding
    default = 16 if per_key else 64
    assert tuning.recurrent_config(per_key=per_key).chunk == default
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(run(chunk_size=default)))


@pytest.mark.parametrize("kind, platform, arch", [
    ("NVIDIA H200", "gpu", "sm90"), ("NVIDIA H100 80GB HBM3", "gpu", "sm90"), ("gfx942", "rocm", "gfx942"),
    ("AMD Instinct MI300X", "rocm", "gfx942"), ("gfx950", "rocm", "gfx950"), ("AMD Instinct MI355X", "rocm", "gfx950"),
    ("NVIDIA A100-SXM4-80GB", "gpu", "fallback"), ("cpu", "cpu", "fallback"),
])
def test_tuning_lookup(kind, platform, arch):
    assert tuning.arch_of(kind, platform) == arch
    cfg = tuning.recurrent_config(arch)
    assert cfg is tuning.RECURRENT[arch] and cfg.block_v & (cfg.block_v - 1) == 0
    cfg = tuning.recurrent_config(arch, per_key=True)
    assert cfg is tuning.RECURRENT_KDA[arch] and cfg.block_v & (cfg.block_v - 1) == 0 and cfg.chunk == 16


def test_runs_per_batch_shard_under_a_mesh():
    """Under ``jax.set_mesh`` the kernels run on each device's batch shard (XLA cannot partition Pallas calls)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    inputs, weights = make_inputs(7, B=8, T=20)
    names = [n for n in ARGS if inputs[n] is not None]
    grad_fn = jax.jit(lambda *xs: value_and_grads(pallas(16), dict(zip(names, xs, strict=True)), weights,
                                                  final_state=True))
    o, ht, grads = grad_fn(*(inputs[n] for n in names))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    sharded = jax.device_put([inputs[n] for n in names], NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(grad_fn)(*sharded))
        o_s, ht_s, grads_s = grad_fn(*sharded)
    assert o_s.sharding.spec == PartitionSpec(("data", "fsdp"))
    assert rel_rms(o_s, o) <= 1e-6 and rel_rms(ht_s, ht) <= 1e-6
    for name in names:
        assert rel_rms(grads_s[name], grads[name]) <= 1e-6, name
