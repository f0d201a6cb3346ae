"""The Pallas flash attention (interpreted on CPU) equals the float32 softmax reference: values and gradients,
ragged T, qk head dim != v head dim, bf16 and float32, causal and not; plus the impl choice and cuDNN padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import kernels
from hybrid_jax.kernels import cudnn_attention as cudnn
from hybrid_jax.kernels import flash_attention as flash
from hybrid_jax.kernels import reference, tuning
from tests.conftest import rel_err

# Several blocks per sequence, a different tiling in each kernel (exercises the padded row statistics).
SMALL = tuning.AttentionConfig(
    fwd=tuning.AttentionKernel(32, 16),
    dkdv=tuning.AttentionKernel(16, 32),
    dq=tuning.AttentionKernel(64, 16),
)
TOL = {jnp.float32: (1e-4, 1e-4), jnp.bfloat16: (5e-3, 2e-2)}  # (forward, gradients), relative RMS


def make_inputs(B, T, H, dqk, dv, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, dqk), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, H, dqk), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, dv), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, dv), jnp.float32).astype(dtype)
    return q, k, v, do


CASES = [  # T, Dqk, Dv, dtype, causal, scale, config
    pytest.param(37, 48, 32, jnp.float32, True, None, None, id="T37-qk48-v32-f32-causal"),
    pytest.param(100, 48, 32, jnp.float32, False, None, SMALL, id="T100-qk48-v32-f32-full-blocks"),
    pytest.param(100, 64, 64, jnp.bfloat16, True, None, SMALL, id="T100-qk64-v64-bf16-causal-blocks"),
    pytest.param(128, 32, 16, jnp.float32, True, 0.3, SMALL, id="T128-qk32-v16-f32-causal-scale"),
    pytest.param(37, 48, 32, jnp.bfloat16, True, None, None, id="T37-qk48-v32-bf16-causal"),
]


@pytest.mark.parametrize("T,dqk,dv,dtype,causal,scale,config", CASES)
def test_flash_matches_reference(T, dqk, dv, dtype, causal, scale, config):
    q, k, v, do = make_inputs(2, T, 2, dqk, dv, dtype)

    def ours(q, k, v):
        return flash.flash_attention(q, k, v, causal=causal, scale=scale, config=config, interpret=True)

    def ref(q, k, v):
        f32 = lambda x: x.astype(jnp.float32)
        return reference.naive_attention(f32(q), f32(k), f32(v), causal=causal, scale=scale)

    o, vjp = jax.vjp(ours, q, k, v)
    o_ref, vjp_ref = jax.vjp(ref, q, k, v)
    assert o.shape == (2, T, 2, dv) and o.dtype == dtype
    fwd_tol, grad_tol = TOL[dtype]
    assert rel_err(o, o_ref) <= fwd_tol
    for name, g, g_ref in zip("qkv", vjp(do), vjp_ref(do.astype(jnp.float32)), strict=True):
        assert g.dtype == dtype, name
        assert rel_err(g, g_ref) <= grad_tol, name


def test_causal_output_ignores_future_tokens():
    q, k, v, _ = make_inputs(1, 50, 1, 16, 16, jnp.float32)
    o = flash.flash_attention(q, k, v, config=SMALL, interpret=True)
    late = v.at[:, 30:].set(100.0)  # changing values from t=30 on must not move outputs before t=30
    o2 = flash.flash_attention(q, k, late, config=SMALL, interpret=True)
    np.testing.assert_array_equal(o[:, :30], o2[:, :30])
    assert not np.allclose(o[:, 30:], o2[:, 30:])


def test_api_dispatch_on_cpu():
    q, k, v, _ = make_inputs(1, 20, 2, 24, 16, jnp.float32)
    assert cudnn.auto_impl(q, v) == "xla"
    want = reference.naive_attention(q, k, v)
    np.testing.assert_array_equal(kernels.attention(q, k, v), want)
    np.testing.assert_allclose(kernels.attention(q, k, v, impl="pallas_interpret"), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="share a dtype"):
        flash.flash_attention(q, k, v.astype(jnp.bfloat16), interpret=True)


def test_cudnn_head_dim_rule():
    bf = lambda d: jnp.zeros((1, 4, 1, d), jnp.bfloat16)
    assert cudnn.cudnn_head_dim(bf(64), bf(64)) == 64
    assert cudnn.cudnn_head_dim(bf(48), bf(32)) == 48
    assert cudnn.cudnn_head_dim(bf(20), bf(30)) == 32
    assert cudnn.cudnn_head_dim(bf(192), bf(128)) is None
    assert cudnn.cudnn_head_dim(bf(64).astype(jnp.float32), bf(64)) is None


@pytest.mark.parametrize("dqk,dv", [(48, 32), (16, 40)])
def test_cudnn_padding_keeps_the_math(monkeypatch, dqk, dv):
    """The head-dim padding around cuDNN is exact: checked with XLA standing in for cuDNN (no GPU here)."""
    dpa = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: dpa(*a, **{**kw, "implementation": "xla"}))
    q, k, v, _ = make_inputs(1, 33, 2, dqk, dv, jnp.bfloat16)
    o = cudnn.cudnn_attention(q, k, v, causal=True)
    want = reference.naive_attention(q, k, v)
    assert o.shape == want.shape
    assert rel_err(o, want) <= 5e-3
