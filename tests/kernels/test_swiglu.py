"""SwiGLU's backward kernel (interpret mode) against autodiff of ``silu(gate) * up`` in float32 and against its XLA
form, on ``fc = [gate | up]`` whose row count and half width are not powers of two; it lowers for every GPU arch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels.swiglu import swiglu, swiglu_backward_reference
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower


@pytest.mark.parametrize("shape, dtype", [((3, 7, 400), jnp.float32), ((2, 5, 1280), jnp.bfloat16)])
def test_swiglu_gradients_match_autodiff(shape, dtype):
    """21 rows of halves of 200 (tiles of 1 x 8) and 10 rows of halves of 640 (2 x 128)."""
    kf, kd = jax.random.split(jax.random.key(0))
    fc = (3.0 * jax.random.normal(kf, shape)).astype(dtype)
    dh = jax.random.normal(kd, (*shape[:-1], shape[-1] // 2)).astype(dtype)

    def f32(f):  # the ground truth: float32 autodiff of the two halves, from the same inputs
        gate, up = jnp.split(f, 2, axis=-1)
        return jax.nn.silu(gate) * up

    want_h, vjp = jax.vjp(f32, fc.astype(jnp.float32))
    (want,) = vjp(dh.astype(jnp.float32))
    assert np.abs(want[..., shape[-1] // 2:]).max() > 0.1  # dup is not zero: both halves are checked
    tol = 1e-5 if dtype == jnp.float32 else 8e-3  # bf16: one rounding of each output
    for impl in ("pallas_interpret", "xla"):
        h, vjp = jax.vjp(lambda f, impl=impl: swiglu(f, impl=impl), fc)
        (got,) = vjp(dh)
        np.testing.assert_allclose(np.asarray(h, np.float32), want_h, rtol=tol, atol=tol)
        assert got.dtype == dtype and got.shape == shape
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    (kernel,) = jax.vjp(lambda f: swiglu(f, impl="pallas_interpret"), fc)[1](dh)
    np.testing.assert_allclose(np.asarray(kernel, np.float32),
                               np.asarray(swiglu_backward_reference(dh, fc), np.float32), rtol=tol, atol=tol)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"last axis must hold \[gate \| up\]"):
        swiglu(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="impl must be one of"):
        swiglu(jnp.zeros((2, 4)), impl="triton")


@pytest.mark.parametrize("overwrite_fc", [True, False])
@pytest.mark.parametrize("arch", list(TARGETS))
def test_lowers_to_triton(arch, overwrite_fc):
    x = jax.ShapeDtypeStruct((4, 100, 192), jnp.bfloat16)
    fn = jax.grad(lambda f: jnp.sum(swiglu(f, impl="pallas", overwrite_fc=overwrite_fc).astype(jnp.float32)))
    text = lower(fn, (x,), arch)
    assert text.count(TRITON_CALL) == 1
    # d[gate | up] (output 0) written over [gate | up] (operand 1) unless a recomputed MLP reads it again
    assert ("output_operand_alias<output_tuple_indices = [], operand_index = 1," in text) == overwrite_fc
