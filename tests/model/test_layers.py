"""Sublayers one by one: causality, Mamba2/GDN against token-by-token references, RoPE/YaRN, conv, norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.model.gdn import GatedDeltaNet
from hybrid_jax.model.kda import KimiDeltaAttention
from hybrid_jax.model.layers import MLP, GatedRMSNorm, ShortConv
from hybrid_jax.model.mamba2 import Mamba2
from hybrid_jax.model.mla import MLA, apply_rope, rope_frequencies
from tests.conftest import jaxpr_equations, load_config, rel_err

KINDS = {"mla": MLA, "gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2, "mlp": MLP}
B, T = 2, 40  # the demo's chunk size is 16: three chunks, the last one partial


@pytest.fixture(scope="module")
def cfg():
    c = load_config("demo").model
    assert c.dtype == "float32"
    return c


def jitted(module: nnx.Module):
    """``module`` as a jitted function of its input (compiled once, called many times)."""
    graphdef, state = nnx.split(module)
    f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    return lambda x: f(state, x)


def apply(module: nnx.Module, x: jax.Array) -> jax.Array:
    return jitted(module)(x)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sublayer_is_causal(cfg, kind):
    f = jitted(KINDS[kind](cfg, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.hidden_size))
    y = f(x)
    assert y.shape == x.shape and bool(jnp.isfinite(y).all())
    scale = float(jnp.abs(y).max())
    for t in (0, 21, T - 1):
        y2 = f(x.at[:, t].add(1.0))
        np.testing.assert_allclose(y2[:, :t], y[:, :t], atol=1e-6 * scale, rtol=0)
        assert float(jnp.abs(y2[:, t] - y[:, t]).max()) > 1e-2 * scale  # the change is seen at t itself


def _np(p) -> np.ndarray:
    return np.asarray(p[...], np.float64)


def _silu(x):
    return x / (1 + np.exp(-x))


def _softplus(x):
    return np.log1p(np.exp(x))


def _conv_silu(x, kernel, bias=0.0):
    """Depthwise causal conv + SiLU, ``x: [B,T,C]``, ``kernel: [K,C]``."""
    K = kernel.shape[0]
    xp = np.pad(x, ((0, 0), (K - 1, 0), (0, 0)))
    return _silu(sum(xp[:, j:j + x.shape[1]] * kernel[j] for j in range(K)) + bias)


def _rms(x, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def test_mamba2_matches_token_by_token_ssm(cfg):
    """SSD through simple GLA (grouping, scale 1, D skip, gate-first group norm) against Mamba2's recurrence."""
    m = Mamba2(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (B, T, cfg.hidden_size))
    y = apply(m, x)
    d_in, nh, hd, G, N = m.d_in, m.nheads, m.head_dim, m.groups, m.state
    proj = np.asarray(x, np.float64) @ _np(m.in_proj.kernel)
    z, xbc, dt = proj[..., :d_in], proj[..., d_in:2 * d_in + 2 * G * N], proj[..., 2 * d_in + 2 * G * N:]
    xbc = _conv_silu(xbc, _np(m.conv1d.kernel), _np(m.conv1d.bias))
    xs = xbc[..., :d_in].reshape(B, T, nh, hd)
    Bm = xbc[..., d_in:d_in + G * N].reshape(B, T, G, N)
    Cm = xbc[..., d_in + G * N:].reshape(B, T, G, N)
    dt = _softplus(dt + _np(m.dt_bias))
    A = -np.exp(_np(m.A_log))
    group = np.arange(nh) // (nh // G)
    S = np.zeros((B, nh, hd, N))
    ys = np.zeros((B, T, nh, hd))
    for t in range(T):
        decay = np.exp(dt[:, t] * A)[:, :, None, None]
        S = decay * S + (dt[:, t, :, None] * xs[:, t])[..., None] * Bm[:, t, group][:, :, None, :]
        ys[:, t] = np.einsum("bhpn,bhn->bhp", S, Cm[:, t, group]) + _np(m.D)[:, None] * xs[:, t]
    g = (ys.reshape(B, T, d_in) * _silu(z)).reshape(B, T, G, d_in // G)
    g = _rms(g, m.norm.eps)
    ref = (g.reshape(B, T, d_in) * _np(m.norm.weight)) @ _np(m.out_proj.kernel)
    assert rel_err(y, ref) < 1e-4


def _delta_rule(q, k, v, g, beta):
    """Token-by-token gated delta rule with l2-normalised q/k and grouped value heads (the spec, in float64).

    ``q, k: [B,T,Hk,dk]``, ``v: [B,T,Hv,dv]``, ``g: [B,T,Hv]`` or ``[B,T,Hv,dk]``, ``beta: [B,T,Hv]``.
    """
    hk, dk, hv = q.shape[2], q.shape[3], v.shape[2]
    l2 = lambda u: u / np.sqrt((u**2).sum(-1, keepdims=True) + 1e-6)
    head = np.arange(hv) // (hv // hk)
    q, k = l2(q)[:, :, head] * dk**-0.5, l2(k)[:, :, head]
    decay = np.exp(g)[..., None] if g.ndim == 4 else np.exp(g)[..., None, None]
    S = np.zeros((q.shape[0], hv, dk, v.shape[3]))
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * decay[:, t]
        err = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + np.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], err)
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o


def test_gdn_matches_token_by_token_delta_rule(cfg):
    """Projection split order, grouped value heads, gates and the silu-gated output norm against the spec."""
    m = GatedDeltaNet(cfg, rngs=nnx.Rngs(5))
    x = jax.random.normal(jax.random.key(6), (B, T, cfg.hidden_size))
    hk, dk, hv, dv = m.hk, m.dk, m.hv, m.dv
    proj = np.asarray(x, np.float64) @ _np(m.in_proj.kernel)
    qkv, z, b, a = np.split(proj, np.cumsum([2 * hk * dk + hv * dv, hv * dv, hv]), axis=-1)
    q, k, v = np.split(_conv_silu(qkv, _np(m.conv1d.kernel)), np.cumsum([hk * dk, hk * dk]), axis=-1)
    g = -np.exp(_np(m.A_log)) * _softplus(a + _np(m.dt_bias))
    o = _delta_rule(q.reshape(B, T, hk, dk), k.reshape(B, T, hk, dk), v.reshape(B, T, hv, dv), g,
                    1 / (1 + np.exp(-b)))
    o = _rms(o, cfg.norm_eps) * _np(m.out_norm.weight) * _silu(z.reshape(B, T, hv, dv))
    assert rel_err(apply(m, x), o.reshape(B, T, hv * dv) @ _np(m.out_proj.kernel)) < 1e-4


def test_kda_matches_token_by_token_delta_rule(cfg):
    """KDA: low-rank per-channel decay gate, sigmoid output gate with bias, against the spec."""
    m = KimiDeltaAttention(cfg, rngs=nnx.Rngs(7))
    x = jax.random.normal(jax.random.key(8), (B, T, cfg.hidden_size))
    hk, dk, hv, dv = m.hk, m.dk, m.hv, m.dv
    proj = np.asarray(x, np.float64) @ _np(m.in_proj.kernel)
    qkv, f_a, g_a, b = np.split(proj, np.cumsum([2 * hk * dk + hv * dv, dv, dv]), axis=-1)
    q, k, v = np.split(_conv_silu(qkv, _np(m.conv1d.kernel)), np.cumsum([hk * dk, hk * dk]), axis=-1)
    f = (f_a @ _np(m.f_b_proj.kernel)).reshape(B, T, hv, dk)
    g = -np.exp(_np(m.A_log))[:, None] * _softplus(f + _np(m.dt_bias).reshape(hv, dk))
    o = _delta_rule(q.reshape(B, T, hk, dk), k.reshape(B, T, hk, dk), v.reshape(B, T, hv, dv), g,
                    1 / (1 + np.exp(-b)))
    gate = 1 / (1 + np.exp(-(g_a @ _np(m.g_b_proj.kernel) + _np(m.g_b_proj.bias))))
    o = _rms(o, cfg.norm_eps) * _np(m.out_norm.weight) * gate.reshape(B, T, hv, dv)
    assert rel_err(apply(m, x), o.reshape(B, T, hv * dv) @ _np(m.out_proj.kernel)) < 1e-4


def test_mla_matches_direct_attention(cfg):
    """Head layouts ([nope | rope] queries, [k_nope | v] keys/values), the shared rope key and the softmax scale."""
    m = MLA(cfg, rngs=nnx.Rngs(9))
    x = jax.random.normal(jax.random.key(10), (B, T, cfg.hidden_size))
    H, dn, dr, dv, r = m.num_heads, m.nope, m.rope, m.v_dim, m.kv_lora_rank
    x64 = np.asarray(x, np.float64)
    q = (_rms(x64 @ _np(m.linear_q_down_proj.kernel), cfg.norm_eps) * _np(m.q_layernorm.weight)
         @ _np(m.linear_q_up_proj.kernel)).reshape(B, T, H, dn + dr)
    down = x64 @ _np(m.linear_kv_down_proj.kernel)
    kv = (_rms(down[..., :r], cfg.norm_eps) * _np(m.kv_layernorm.weight)
          @ _np(m.linear_kv_up_proj.kernel)).reshape(B, T, H, dn + dv)
    angle = np.arange(T)[:, None] * (1.0 / cfg.mla.rope_theta ** (np.arange(0, dr, 2) / dr))[None]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]

    def rope(u):  # [B,T,h,dr], rotate-half
        u1, u2 = u[..., : dr // 2], u[..., dr // 2:]
        return np.concatenate([u1 * cos - u2 * sin, u2 * cos + u1 * sin], -1)

    qf = np.concatenate([q[..., :dn], rope(q[..., dn:])], -1)
    kf = np.concatenate([kv[..., :dn], np.broadcast_to(rope(down[..., None, r:]), (B, T, H, dr))], -1)
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) / np.sqrt(dn + dr)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), kv[..., dn:])
    assert rel_err(apply(m, x), o.reshape(B, T, H * dv) @ _np(m.linear_proj.kernel)) < 1e-4


def test_plain_rope_is_exact_at_factor_one(cfg):
    mla = cfg.mla
    inv_freq, magnitude = rope_frequencies(mla)
    d = mla.qk_rope_head_dim
    np.testing.assert_array_equal(inv_freq, 1.0 / mla.rope_theta ** (np.arange(0, d, 2) / d))
    assert magnitude == 1.0
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, d))
    y = apply_rope(x, inv_freq, magnitude)
    np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-7)  # position 0 is the identity
    pos, i = 3, 1  # channel i pairs with i + d/2 (rotate-half), angle pos * inv_freq[i]
    c, s = np.cos(pos * inv_freq[i]), np.sin(pos * inv_freq[i])
    x1, x2 = x[0, pos, 0, i], x[0, pos, 0, i + d // 2]
    np.testing.assert_allclose([y[0, pos, 0, i], y[0, pos, 0, i + d // 2]], [x1 * c - x2 * s, x2 * c + x1 * s],
                               rtol=1e-5)


def test_rope_scores_depend_on_relative_position_only(cfg):
    inv_freq, magnitude = rope_frequencies(cfg.mla)
    d = cfg.mla.qk_rope_head_dim
    q, k = np.random.default_rng(0).normal(size=(2, d)).astype(np.float32)
    rot = lambda u: np.asarray(apply_rope(jnp.broadcast_to(u, (1, 12, 1, d)), inv_freq, magnitude))[0, :, 0]
    rq, rk = rot(q), rot(k)
    np.testing.assert_allclose(rq[7] @ rk[4], rq[3] @ rk[0], rtol=1e-4)
    np.testing.assert_allclose(rq[11] @ rk[2], rq[9] @ rk[0], rtol=1e-4)


def test_yarn_interpolates_low_frequencies(cfg):
    mla = cfg.mla.copy_and_resolve_references()
    mla.rope_scaling_factor, mla.mscale, mla.mscale_all_dim = 4.0, 1.0, 0.0
    plain, _ = rope_frequencies(cfg.mla)
    yarn, magnitude = rope_frequencies(mla)
    assert yarn[0] == plain[0]  # highest frequency: extrapolated (kept)
    assert yarn[-1] == pytest.approx(plain[-1] / 4.0)  # lowest frequency: interpolated by the factor
    assert np.all(yarn <= plain) and np.all(yarn >= plain / 4.0 * (1 - 1e-12))
    assert magnitude == pytest.approx(0.1 * np.log(4.0) + 1.0)


def test_short_conv_is_a_causal_depthwise_filter():
    conv = ShortConv(3, 4, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 6, 3))
    w, b = np.asarray(conv.kernel[...]), np.asarray(conv.bias[...])
    xn = np.asarray(x)[0]
    pre = np.array([[b[c] + sum(w[j, c] * xn[t - 3 + j, c] for j in range(4) if t - 3 + j >= 0) for c in range(3)]
                    for t in range(6)])
    np.testing.assert_allclose(conv(x)[0], _silu(pre), rtol=1e-5, atol=1e-6)
    assert np.abs(w).max() <= 0.5  # PyTorch default conv init: U(+-1/sqrt(kernel_size))


def test_short_conv_gradient_is_two_kernels_without_shifted_copies():
    """With the Pallas backward (interpret mode) the conv's gradient is two kernels: the only activation-sized pad is
    the forward's causal padding (the XLA form adds one per tap), and it matches the XLA form with documents."""
    conv = ShortConv(40, 4, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                     kernel_impl="pallas_interpret")
    x = jax.random.normal(jax.random.key(1), (2, 21, 40))
    seg = jnp.asarray([[0] * 9 + [1] * 12, [2] * 21])
    graphdef, state = nnx.split(conv)

    def grads(impl):
        def loss(state, x):
            module = nnx.merge(graphdef, state)
            module.kernel_impl = impl
            return jnp.sum(module(x, seg) ** 2)

        fn = jax.grad(loss, argnums=(0, 1))
        return jax.make_jaxpr(fn)(state, x).jaxpr, fn(state, x)

    jaxpr, kernel = grads("pallas_interpret")
    equations = list(jaxpr_equations(jaxpr))
    pads = [e for e in equations if e.primitive.name == "pad" and np.prod(e.outvars[0].aval.shape) > x.size]
    assert len(pads) == 1 and sum(e.primitive.name == "pallas_call" for e in equations) == 2
    for got, want in zip(jax.tree.leaves(kernel), jax.tree.leaves(grads("xla")[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_group_rms_norm_normalises_each_group_after_the_gate():
    norm = GatedRMSNorm(8, groups=2, gate_first=True, eps=1e-5, dtype=jnp.float32)
    y = jax.random.normal(jax.random.key(0), (3, 8)) * 5
    z = jax.random.normal(jax.random.key(1), (3, 8))
    out = np.asarray(norm(y, z)).reshape(3, 2, 4)
    np.testing.assert_allclose(np.sqrt((out**2).mean(-1)), 1.0, rtol=1e-3)
    gated = np.asarray(y * jax.nn.silu(z)).reshape(3, 2, 4)
    np.testing.assert_allclose(out / np.sign(gated), np.abs(out), rtol=1e-6)  # same signs: the gate came first


def test_mlp_is_swiglu_with_one_matmul_per_gradient(cfg):
    """The MLP computes ``fc2(silu(gate) * up)`` with ``[gate | up] = x fc1``; ``fc1`` is one matmul and so is each of
    its gradients (input and weight, contracting over or producing ``2F`` at once), and with the kernel the backward
    concatenates nothing as large as ``[B, T, 2F]`` (the kernel writes ``d [gate | up]`` whole)."""
    mlp = MLP(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (B, T, cfg.hidden_size))
    h = np.asarray(x, np.float64) @ _np(mlp.linear_fc1.kernel)
    gate, up = np.split(h, 2, axis=-1)
    want = (_silu(gate) * up) @ _np(mlp.linear_fc2.kernel)
    assert rel_err(apply(mlp, x), want) < 1e-5
    mlp.kernel_impl = "pallas_interpret"
    graphdef, state = nnx.split(mlp)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    eqns = jaxpr_equations(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, x).jaxpr)
    wide = 2 * cfg.ffn_size
    dots = [[v.aval.shape for v in (*e.invars, *e.outvars)] for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 6, dots  # fc1 and fc2, then per weight its input and weight gradient
    assert sum(any(s[-1:] == (wide,) and len(s) == 3 for s in d) for d in dots) == 3, dots  # fc1, d x, d fc1
    sizes = [int(np.prod(e.outvars[0].aval.shape)) for e in eqns if e.primitive.name == "concatenate"]
    assert all(size < B * T * wide for size in sizes), sizes


def test_token_lookup_gradient_is_a_float32_sum_per_id():
    """``lookup``'s values are ``nnx.Embed``'s; its table gradient sums each id's bfloat16 cotangents in float32 (the
    gather's own transpose adds them in bfloat16), zero for ids not in the batch, and holds under jit and vmap."""
    from flax import nnx

    from hybrid_jax.model.layers import lookup

    rng = np.random.default_rng(0)
    embed = nnx.Embed(300, 8, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    table = embed.embedding[...]
    tokens = jnp.asarray(np.concatenate([np.full((2, 40), 7), rng.integers(0, 20, (2, 24))], axis=1), jnp.int32)
    w = jnp.asarray(rng.standard_normal((2, 64, 8)), jnp.float32)
    assert jnp.array_equal(lookup(table, tokens, jnp.bfloat16), embed(tokens))
    grad = jax.jit(jax.grad(lambda t: jnp.sum(lookup(t, tokens, jnp.bfloat16).astype(jnp.float32) * w)))(table)
    cot = w.astype(jnp.bfloat16).astype(np.float64).reshape(-1, 8)
    want = np.zeros((300, 8))
    np.add.at(want, np.asarray(tokens).reshape(-1), cot)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)  # 80 adds of id 7 in bfloat16 miss by ~1e-1
    assert grad.dtype == jnp.float32 and not np.any(grad[20:])
    per_row = jax.vmap(jax.grad(lambda t, x, v: jnp.sum(lookup(t, x, jnp.bfloat16).astype(jnp.float32) * v)),
                       in_axes=(None, 0, 0))
    np.testing.assert_allclose(per_row(table, tokens, w).sum(0), grad, rtol=1e-5, atol=1e-5)
