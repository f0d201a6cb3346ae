"""The vocabulary-chunked cross-entropy equals the plain one (values and gradients) and never builds full logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.train.loss import cross_entropy, plain_cross_entropy


@pytest.mark.parametrize("vocab,chunk", [(96, 32), (100, 32), (50, 64)])
def test_chunked_equals_plain_float32(vocab, chunk):
    kh, ke, kt = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (3, 5, 24))
    e = 0.3 * jax.random.normal(ke, (vocab, 24))
    t = jax.random.randint(kt, (3, 5), 0, vocab)
    chunked = lambda h, e: cross_entropy(h, e, t, chunk_size=chunk)
    plain = lambda h, e: plain_cross_entropy(h, e, t)
    np.testing.assert_allclose(jax.jit(chunked)(h, e), plain(h, e), rtol=1e-6, atol=1e-5)
    for got, want in zip(jax.grad(chunked, (0, 1))(h, e), jax.grad(plain, (0, 1))(h, e), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_loss_of_uniform_logits_is_log_vocab():
    h = jnp.zeros((4, 8))
    e = jnp.ones((1000, 8))
    t = jnp.arange(4) * 7
    np.testing.assert_allclose(cross_entropy(h, e, t, chunk_size=128), np.log(1000), rtol=1e-6)


def test_bfloat16_features_close_to_float32():
    kh, ke, kt = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(kh, (64, 32))
    e = 0.2 * jax.random.normal(ke, (300, 32))
    t = jax.random.randint(kt, (64,), 0, 300)
    ref = plain_cross_entropy(h, e, t)
    got = cross_entropy(h.astype(jnp.bfloat16), e, t, chunk_size=128)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=2e-2)


def test_no_full_logits_in_the_compiled_program():
    """No [tokens, vocab] float32 buffer: the largest intermediate is a [tokens, chunk] block."""
    n, d, v, chunk = 256, 16, 4096, 256
    h, e, t = jnp.ones((n, d)), jnp.ones((v, d)), jnp.zeros((n,), jnp.int32)
    grad = jax.jit(jax.grad(lambda h, e: cross_entropy(h, e, t, chunk_size=chunk), (0, 1)))
    text = grad.lower(h, e).as_text()
    assert f"tensor<{n}x{v}xf32>" not in text
    assert f"tensor<{n}x{chunk}xf32>" in text
