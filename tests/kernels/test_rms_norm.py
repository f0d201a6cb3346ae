"""The residual stream's add and RMSNorm (``kernels/rms_norm.py``): the kernels (interpret mode) and the XLA form
against float32 autodiff of the plain formula, with ragged tiles and rows that are not a power of two; they lower
to one launch each way for every GPU arch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.rms_norm import add_rms_norm, rms_norm
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower

EPS = 1e-5


def plain(x, y, w, dtype):
    """The pre-norm stream as the model wrote it before the kernels, the sum stored in ``dtype`` (float32 autodiff
    is the ground truth)."""
    s = (x + y).astype(dtype).astype(jnp.float32)
    return s, s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + EPS) * w


# (x's shape, dtype, the launch's elements per tile and backward programs): 45 rows of 96 channels (tiles of 16 rows
# padded to 128 columns: 3 tiles, the last ragged, over 2 programs backward, 2 and 1), and 21 rows of 64 in float32
# (tiles of 16 rows, one program backward takes both)
@pytest.mark.parametrize("shape, dtype, block, programs", [((3, 15, 96), jnp.bfloat16, 2048, 2),
                                                           ((3, 7, 64), jnp.float32, 1024, 1)])
def test_add_rms_norm_matches_autodiff(monkeypatch, shape, dtype, block, programs):
    config = tuning.NormConfig
    monkeypatch.setattr(tuning, "NormConfig", lambda: config(block=block, programs=programs))
    assert config(block=block).tile_rows(shape[-1]) == 16
    kx, ky, kw, ks, kh = jax.random.split(jax.random.key(0), 5)
    x = (3.0 * jax.random.normal(kx, shape)).astype(dtype)
    y = jax.random.normal(ky, shape).astype(dtype)
    w = 1.0 + 0.3 * jax.random.normal(kw, shape[-1:])
    ds = jax.random.normal(ks, shape).astype(dtype)
    dh = jax.random.normal(kh, shape).astype(jnp.bfloat16)
    f32 = [a.astype(jnp.float32) for a in (x, y, w)]
    (want_s, want_h), vjp = jax.vjp(lambda x, y, w: plain(x, y, w, dtype), *f32)
    want = vjp((ds.astype(jnp.float32), dh.astype(jnp.float32)))
    results = {}
    for impl in ("pallas_interpret", "xla"):
        (s, h), vjp = jax.vjp(lambda x, y, w, impl=impl: add_rms_norm(x, y, w, eps=EPS, out_dtype=jnp.bfloat16,
                                                                         impl=impl), x, y, w)
        assert s.dtype == dtype and h.dtype == jnp.bfloat16
        np.testing.assert_array_equal(s, x + y)  # one rounding of the sum, as XLA adds
        np.testing.assert_allclose(np.asarray(h, np.float32), want_h, rtol=8e-3, atol=8e-3)
        grads = vjp((ds, dh))
        for got, ref, a in zip(grads, want, (x, y, w), strict=True):
            assert got.dtype == a.dtype and got.shape == a.shape
            tol = 1e-4 if got.dtype == jnp.float32 else 8e-3  # bf16: one rounding of each output
            np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())
        results[impl] = h, grads
    # the final norm's use: s read by nothing later (the kernel then takes no ds)
    h_only = jax.vjp(lambda x, y, w: add_rms_norm(x, y, w, eps=EPS, out_dtype=jnp.bfloat16,
                                                  impl="pallas_interpret")[1], x, y, w)[1](dh)
    want_h_only = jax.vjp(lambda x, y, w: plain(x, y, w, dtype)[1], *f32)[1](dh.astype(jnp.float32))
    for got, ref in zip(h_only, want_h_only, strict=True):
        tol = 1e-4 if got.dtype == jnp.float32 else 8e-3
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())
    # the forward kernel against the XLA form: the same float32 arithmetic on the same stored s
    kernel = add_rms_norm(x, y, w, eps=EPS, out_dtype=jnp.float32, impl="pallas_interpret")[1]
    np.testing.assert_allclose(kernel, rms_norm(x + y, w, eps=EPS, out_dtype=jnp.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(results["pallas_interpret"][1][0], results["pallas_interpret"][1][1])  # dx = dy


def test_add_rms_norm_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match=r"x, y \[..., D\] of one dtype and w \[D\]"):
        add_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8), jnp.bfloat16), jnp.ones(8), eps=EPS,
                     out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"w \[4\]"):
        add_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8)), jnp.ones(4), eps=EPS, out_dtype=jnp.float32)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_add_rms_norm_is_one_triton_call_each_way(arch):
    """Rows of 3,072 channels (the 3B's: masked to 4,096), a ragged count: one Pallas launch forward, one
    backward."""
    x = jax.ShapeDtypeStruct((2, 150, 3072), jnp.bfloat16)

    def loss(x, y, w):
        s, h = add_rms_norm(x, y, w, eps=EPS, out_dtype=jnp.bfloat16, impl="pallas")
        return (s.astype(jnp.float32) * h.astype(jnp.float32)).sum()

    args = (x, x, jax.ShapeDtypeStruct((3072,), jnp.float32))
    assert lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), args, arch).count(TRITON_CALL) == 2
