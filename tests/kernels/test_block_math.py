"""In-kernel tile math (``kernels/recurrent/block_math.py``): KDA's diagonal-block products around one reference row
against the exact decayed Gram product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels.recurrent import block_math
from tests.kernels.conftest import rel_rms


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
