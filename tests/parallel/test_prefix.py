"""The chains of affine state maps over a context axis' shards or a shard's groups (``kernels/recurrent/prefix.py``,
``log2 n`` levels of batched products) against their definition, one part after the other: every part's start
state and the final state, every part's end-state gradient; ``n`` 1 to 8 parts (powers of two and not), ``[K, K]``
and scalar transitions, documents cutting the chain (part 0's flag ignored: it starts from the given state)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels.recurrent import prefix

B, HV, K, V = 2, 3, 4, 5


def starts_one_by_one(m, s, keeps, h0):
    state = jnp.zeros_like(s[0]) if h0 is None else h0
    starts = []
    for i in range(m.shape[0]):
        if i and keeps is not None:
            state = jnp.where(keeps[i][:, None, None, None], state, 0.0)
        starts.append(state)
        state = prefix.carry(m[i], state) + s[i]
    return jnp.stack(starts), state


def ends_one_by_one(m, own, keeps, d):
    ends = [d]
    for i in range(m.shape[0] - 1, 0, -1):
        d = own[i] + prefix.carry(m[i], d, transpose=True)
        if keeps is not None:
            d = jnp.where(keeps[i][:, None, None, None], d, 0.0)
        ends.append(d)
    return jnp.stack(ends[::-1])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("scalar", [False, True], ids=["matrix", "scalar"])
def test_chains_equal_one_part_after_the_other(n: int, scalar: bool):
    rng = np.random.default_rng(n)
    m = jnp.asarray(rng.normal(size=(n, B, HV) if scalar else (n, B, HV, K, K)), jnp.float32) * 0.5
    s = jnp.asarray(rng.normal(size=(n, B, HV, K, V)), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=(B, HV, K, V)), jnp.float32)
    d = jnp.asarray(rng.normal(size=(B, HV, K, V)), jnp.float32)
    cut = jnp.asarray(rng.random((n, B)) > 0.3).at[0].set(False)  # part 0's flag is not read
    for keeps in (None, cut):
        for init in (None, h0):
            for got, want in zip(prefix.shard_prefix(m, s, keeps, init), starts_one_by_one(m, s, keeps, init),
                                 strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(prefix.reverse_prefix(m, s, keeps, d), ends_one_by_one(m, s, keeps, d),
                                   rtol=1e-5, atol=1e-5)
