"""SwiGLU's backward kernel (interpret mode) against autodiff of ``silu(gate) * up`` in float32 and against its XLA
form, with a ragged last block; it lowers for every GPU arch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.swiglu import swiglu, swiglu_backward_reference
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower


@pytest.mark.parametrize("shape, dtype", [((3, 7, 200), jnp.float32), ((2, 5, 640), jnp.bfloat16)])
def test_swiglu_gradients_match_autodiff(shape, dtype):
    """4,200 and 6,400 elements in blocks of ``ElementwiseConfig().block`` (2,048): a masked last block in both."""
    assert np.prod(shape) % tuning.ElementwiseConfig().block and np.prod(shape) > tuning.ElementwiseConfig().block
    kg, ku, kd = jax.random.split(jax.random.key(0), 3)
    gate = (3.0 * jax.random.normal(kg, shape)).astype(dtype)
    up = jax.random.normal(ku, shape).astype(dtype)
    dh = jax.random.normal(kd, shape).astype(dtype)

    def f32(g, u):  # the ground truth: float32 autodiff from the same inputs
        return jax.nn.silu(g) * u

    want_h, vjp = jax.vjp(f32, gate.astype(jnp.float32), up.astype(jnp.float32))
    want = vjp(dh.astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 8e-3  # bf16: one rounding of each output
    for impl in ("pallas_interpret", "xla"):
        h, vjp = jax.vjp(lambda g, u, impl=impl: swiglu(g, u, impl=impl), gate, up)
        grads = vjp(dh)
        np.testing.assert_allclose(np.asarray(h, np.float32), want_h, rtol=tol, atol=tol)
        for got, ref in zip(grads, want, strict=True):
            assert got.dtype == dtype and got.shape == shape
            np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=tol, atol=tol)
    kernel = jax.vjp(lambda g, u: swiglu(g, u, impl="pallas_interpret"), gate, up)[1](dh)
    for got, ref in zip(kernel, swiglu_backward_reference(dh, gate, up), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="gate and up must share shape"):
        swiglu(jnp.zeros((2, 3)), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="impl must be one of"):
        swiglu(jnp.zeros((2, 3)), jnp.zeros((2, 3)), impl="triton")


@pytest.mark.parametrize("arch", list(TARGETS))
def test_lowers_to_triton(arch):
    x = jax.ShapeDtypeStruct((4, 100, 96), jnp.bfloat16)
    fn = jax.grad(lambda g, u: jnp.sum(swiglu(g, u, impl="pallas").astype(jnp.float32)), (0, 1))
    assert lower(fn, (x, x), arch).count(TRITON_CALL) == 1
