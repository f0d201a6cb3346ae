"""The delta rules' q/k l2 norm (``kernels/l2_norm.py``): the kernels (interpret mode) against float32 autodiff of the
reference with ragged tiles and rows that are not a power of two; one launch each way for every GPU arch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import reference
from hybrid_jax.kernels.l2_norm import l2_norm
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower

EPS = reference.L2NORM_EPS


# 3 x 37 x 4 rows of 64 (tiles of 32 rows: the last ragged) in bf16; rows of 48 (masked to 64) in float32
@pytest.mark.parametrize("shape, dtype, tol", [((3, 37, 4, 64), jnp.bfloat16, 8e-3),
                                                ((2, 9, 3, 48), jnp.float32, 1e-5)])
def test_l2_norm_matches_autodiff(shape, dtype, tol):
    x = (3.0 * jax.random.normal(jax.random.key(0), shape)).astype(dtype)
    dy = jax.random.normal(jax.random.key(1), shape).astype(dtype)
    want, vjp = jax.vjp(reference.l2_normalize, x.astype(jnp.float32))
    (want_dx,) = vjp(dy.astype(jnp.float32))
    y, vjp = jax.vjp(lambda a: l2_norm(a, eps=EPS, interpret=True), x)
    (dx,) = vjp(dy)
    assert y.dtype == dx.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), want_dx, rtol=tol, atol=tol * np.abs(want_dx).max())


@pytest.mark.parametrize("arch", list(TARGETS))
def test_l2_norm_is_one_triton_call_each_way(arch):
    x = jax.ShapeDtypeStruct((2, 150, 8, 64), jnp.bfloat16)

    def loss(x):
        return l2_norm(x, eps=EPS).astype(jnp.float32).sum()

    assert lower(jax.value_and_grad(loss), (x,), arch).count(TRITON_CALL) == 2
