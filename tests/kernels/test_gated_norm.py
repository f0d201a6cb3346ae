"""The gated RMSNorm's kernels (interpret mode) and its XLA form against float32 autodiff of the plain formula, for
Mamba2's form (gate first, a weight per channel over 4 groups), GDN's (gate after, SiLU, one weight of ``d`` shared
by the heads) and KDA's (sigmoid), with ragged tiles; they lower for every GPU arch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.gated_norm import gated_rms_norm, gated_rms_norm_backward_reference
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower

EPS = 1e-5


def plain(x, z, w, groups, gate_first, activation):
    """The formula as the model wrote it before the kernel (float32 autodiff is the ground truth)."""
    s = jax.nn.silu(z) if activation == "silu" else jax.nn.sigmoid(z)
    u = x * s if gate_first else x
    shape = (*u.shape[:-1], groups, u.shape[-1] // groups)
    u = u.reshape(shape)
    n = (u * jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + EPS)).reshape(x.shape)
    out = (n.reshape(shape) * w.reshape(-1, shape[-1])).reshape(x.shape)
    return out if gate_first else out * s


# (x's shape, groups, weight's width, gate first, activation, x's dtype): Mamba2 (y float32, 4 groups of 40, a
# weight per channel), GDN (bf16 o of 3 heads of 24, one shared weight), KDA (sigmoid); 35-72 group rows in tiles of
# 16 (Mamba2: 5 tiles over 2 programs, 3 and 2) or 32 rows: ragged last tiles
CASES = [((2, 9, 160), 4, 160, True, "silu", jnp.float32),
         ((2, 5, 120), 3, 120, True, "silu", jnp.float32),  # 3 weight groups: not a power of two, the XLA form
         ((2, 7, 3, 24), 1, 24, False, "silu", jnp.bfloat16),
         ((1, 35, 1, 24), 1, 24, False, "sigmoid", jnp.bfloat16)]


@pytest.mark.parametrize("shape, groups, wdim, gate_first, activation, dtype", CASES,
                         ids=["mamba2", "mamba2_3_groups", "gdn", "kda"])
def test_gated_norm_gradients_match_autodiff(monkeypatch, shape, groups, wdim, gate_first, activation, dtype):
    config = tuning.NormConfig
    monkeypatch.setattr(tuning, "NormConfig", lambda: config(block=1024, programs=2))
    kx, kz, kw, kd = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, shape).astype(dtype)
    z = (2.0 * jax.random.normal(kz, shape)).astype(jnp.bfloat16)
    w = 1.0 + 0.3 * jax.random.normal(kw, (wdim,))
    dout = jax.random.normal(kd, shape).astype(jnp.bfloat16)
    f32 = [a.astype(jnp.float32) for a in (x, z, w)]
    want_out, vjp = jax.vjp(lambda x, z, w: plain(x, z, w, groups, gate_first, activation), *f32)
    want = vjp(dout.astype(jnp.float32))
    got_ref = gated_rms_norm_backward_reference(dout, x, z, w, groups=groups, gate_first=gate_first, eps=EPS,
                                                activation=activation)
    for got, ref in zip(got_ref, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for impl in ("pallas_interpret", "xla"):
        out, vjp = jax.vjp(lambda x, z, w, impl=impl: gated_rms_norm(
            x, z, w, groups=groups, gate_first=gate_first, eps=EPS, out_dtype=jnp.bfloat16, activation=activation,
            impl=impl), x, z, w)
        np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=8e-3, atol=8e-3)
        if impl == "pallas_interpret":  # the forward kernel against XLA's form: the same float32 arithmetic
            xla = gated_rms_norm(x, z, w, groups=groups, gate_first=gate_first, eps=EPS, out_dtype=jnp.float32,
                                 activation=activation, impl="xla")
            kernel = gated_rms_norm(x, z, w, groups=groups, gate_first=gate_first, eps=EPS, out_dtype=jnp.float32,
                                    activation=activation, impl=impl)
            np.testing.assert_allclose(kernel, xla, rtol=1e-6, atol=1e-6)
        # the backward keeps the inputs alone: no float32 copy of the activations
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(vjp)] == [(a.shape, a.dtype) for a in (x, z, w)]
        for got, ref, a in zip(vjp(dout), want, (x, z, w), strict=True):
            assert got.dtype == a.dtype and got.shape == a.shape
            tol = 1e-4 if got.dtype == jnp.float32 else 8e-3  # bf16: one rounding of each output
            np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_gated_norm_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="multiple of groups=3"):
        gated_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8)), jnp.ones(8), groups=3, gate_first=True, eps=EPS,
                       out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="activation must be one of silu | sigmoid"):
        gated_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8)), jnp.ones(8), groups=1, gate_first=True, eps=EPS,
                       out_dtype=jnp.float32, activation="tanh")


@pytest.mark.parametrize("arch", list(TARGETS))
def test_gated_norm_is_one_triton_call_each_way(arch):
    """Mamba2's form at a ragged shape (group rows of 40 channels, 8 groups): one Pallas launch forward, one
    backward."""
    args = (jax.ShapeDtypeStruct((2, 300, 320), jnp.float32), jax.ShapeDtypeStruct((2, 300, 320), jnp.bfloat16),
            jax.ShapeDtypeStruct((320,), jnp.float32))

    def loss(x, z, w):
        return gated_rms_norm(x, z, w, groups=8, gate_first=True, eps=EPS, out_dtype=jnp.bfloat16,
                              impl="pallas").astype(jnp.float32).sum()

    assert lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), args, arch).count(TRITON_CALL) == 2
