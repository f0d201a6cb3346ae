"""The chunked pure-JAX forms equal the naive token-by-token recurrences (values and gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import kernels
from hybrid_jax.kernels import reference
from tests.kernels.conftest import make_inputs, problem, rel_rms, steep_gates

naive = jax.jit(reference.naive_recurrence, static_argnames="use_qk_l2norm")
chunked = jax.jit(reference.chunked_recurrence, static_argnames=("use_qk_l2norm", "chunk_size"))


def reference_args(B=2, T=37, H=2, HV=4, K=8, V=6, *, per_key_gate=False, seed=0, steep=False):
    """``(q, k, v, g, beta, s0)`` of a problem with odd head dims (the XLA forms take any), the model's gates
    (``steep``: down to -20 per step)."""
    x, _ = make_inputs(problem("kda" if per_key_gate else "gdn", B=B, T=T, H=H, HV=HV, K=K, V=V), seed)
    x = steep_gates(x, -20.0, seed) if steep else x
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))


CASES = [  # (per_key_gate, delta_rule)
    pytest.param(False, True, id="gdn"),
    pytest.param(True, True, id="kda"),
    pytest.param(False, False, id="gla"),
]


@pytest.mark.parametrize("T,chunk", [(37, 16), (5, 16), (64, 16), (33, 32)])
@pytest.mark.parametrize("per_key_gate,delta", CASES)
def test_chunked_equals_naive_values(T, chunk, per_key_gate, delta):
    q, k, v, g, beta, s0 = reference_args(T=T, per_key_gate=per_key_gate)
    beta = beta if delta else None
    for state in (None, s0):
        o_ref, s_ref = naive(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True)
        o, s = chunked(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True, chunk_size=chunk)
        assert rel_rms(o, o_ref) <= 1e-4
        assert rel_rms(s, s_ref) <= 1e-4


@pytest.mark.parametrize("per_key_gate,delta", CASES)
def test_chunked_equals_naive_gradients(per_key_gate, delta):
    q, k, v, g, beta, s0 = reference_args(T=29, per_key_gate=per_key_gate)
    w_o = jax.random.normal(jax.random.key(7), v.shape)
    w_s = jax.random.normal(jax.random.key(8), s0.shape)

    def loss(fn, q, k, v, g, beta, s0):
        o, s = fn(q, k, v, g, beta if delta else None, initial_state=s0, use_qk_l2norm=True)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    chunk8 = functools.partial(reference.chunked_recurrence, chunk_size=8)
    args = (q, k, v, g, beta, s0)
    argnums = (0, 1, 2, 3, 4, 5) if delta else (0, 1, 2, 3, 5)
    g_ref = jax.jit(jax.grad(lambda *a: loss(reference.naive_recurrence, *a), argnums=argnums))(*args)
    g_chk = jax.jit(jax.grad(lambda *a: loss(chunk8, *a), argnums=argnums))(*args)
    for name, a, b in zip("q k v g beta s0".split() if delta else "q k v g s0".split(), g_chk, g_ref, strict=True):
        assert rel_rms(a, b) <= 1e-4, name


@pytest.mark.parametrize("per_key_gate", [False, True])
def test_strongly_negative_gates_stay_finite(per_key_gate):
    """Gates down to -20 per step: chunk-level decays of exp(-1000) underflow to zero, never overflow."""
    q, k, v, g, beta, s0 = reference_args(T=40, per_key_gate=per_key_gate, steep=True)
    o_ref, s_ref = naive(q, k, v, g, beta, initial_state=s0)
    grads = jax.jit(jax.grad(lambda g: reference.chunked_recurrence(q, k, v, g, beta, initial_state=s0,
                                                                    chunk_size=16)[0].sum()))(g)
    o, s = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert np.isfinite(np.asarray(grads)).all()
    assert rel_rms(o, o_ref) <= 1e-4 and rel_rms(s, s_ref) <= 1e-4


def test_grouped_value_heads_share_qk_heads():
    """With HV = 2H, value heads 2i and 2i+1 read q/k head i (FLA's GVA convention)."""
    q, k, v, g, beta, _ = reference_args(H=2, HV=4)
    o, _ = kernels.chunk_gated_delta_rule(q, k, v, g, beta, impl="xla")
    o_rep, _ = kernels.chunk_gated_delta_rule(jnp.repeat(q, 2, 2), jnp.repeat(k, 2, 2), v, g, beta, impl="xla")
    np.testing.assert_allclose(o, o_rep, rtol=1e-5, atol=1e-5)


def test_simple_gla_matches_a_direct_quadratic_form():
    """o_t = scale * sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s, written independently of the recurrences."""
    q, k, v, g, _, _ = reference_args(H=3, HV=3)
    o, _ = kernels.chunk_simple_gla(q, k, v, g, impl="xla", chunk_size=16)
    G = jnp.cumsum(g, axis=1)  # [B,T,H]
    T = q.shape[1]
    mask = jnp.tril(jnp.ones((T, T), bool))
    decay = jnp.where(mask, jnp.exp(G.transpose(0, 2, 1)[..., :, None] - G.transpose(0, 2, 1)[..., None, :]), 0)
    scores = jnp.einsum("bthk,bshk->bhts", q, k) * decay * q.shape[-1] ** -0.5
    expected = jnp.einsum("bhts,bshv->bthv", scores, v)
    assert rel_rms(o, expected) <= 1e-5


def test_final_state_continues_the_sequence():
    """Running [0, t) then [t, T) from the carried state equals one run over [0, T)."""
    q, k, v, g, beta, _ = reference_args(T=50)
    o_full, s_full = kernels.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, impl="xla")
    cut = 23
    o1, s1 = kernels.chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), output_final_state=True,
                                            impl="xla")
    o2, s2 = kernels.chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=s1,
                                            output_final_state=True, impl="xla")
    assert rel_rms(jnp.concatenate([o1, o2], 1), o_full) <= 1e-5
    assert rel_rms(s2, s_full) <= 1e-5


@pytest.mark.parametrize("op", ["gdn", "kda", "gla"])
def test_outputs_before_t_ignore_inputs_after_t(op):
    """Causality, including through the gates: perturbing step t leaves outputs before t unchanged."""
    q, k, v, g, beta, _ = reference_args(T=40, per_key_gate=op == "kda")
    fn = {
        "gdn": lambda q, k, v, g: kernels.chunk_gated_delta_rule(q, k, v, g, beta, impl="xla")[0],
        "kda": lambda q, k, v, g: kernels.chunk_kda(q, k, v, g, beta, impl="xla")[0],
        "gla": lambda q, k, v, g: kernels.chunk_simple_gla(q, k, v, g, impl="xla")[0],
    }[op]
    t = 21
    base = fn(q, k, v, g)
    bumped = fn(q.at[:, t:].add(1.0), k.at[:, t:].add(1.0), v.at[:, t:].add(1.0), g.at[:, t:].add(-5.0))
    np.testing.assert_array_equal(np.asarray(base[:, :t]), np.asarray(bumped[:, :t]))
    assert not np.allclose(base[:, t:], bumped[:, t:])


def test_bad_shapes_are_clear_errors():
    q, k, v, g, beta, _ = reference_args(H=2, HV=4)
    with pytest.raises(ValueError, match="multiple of H"):
        kernels.chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], impl="xla")
    q, k, v, g, beta, _ = reference_args()
    with pytest.raises(ValueError, match="g must have shape"):
        kernels.chunk_kda(q, k, v, g, beta, impl="xla")
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, impl="cuda")


def test_attention_reference_supports_different_value_dim():
    ks = jax.random.split(jax.random.key(1), 3)
    q, k = jax.random.normal(ks[0], (2, 9, 3, 8)), jax.random.normal(ks[1], (2, 9, 3, 8))
    v = jax.random.normal(ks[2], (2, 9, 3, 5))
    o = kernels.attention(q, k, v, impl="xla")
    assert o.shape == (2, 9, 3, 5)
    # row 0 attends only to position 0
    np.testing.assert_allclose(o[:, 0], v[:, 0], rtol=1e-6)
