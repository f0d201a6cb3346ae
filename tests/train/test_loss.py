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


def _check_against_plain(h, e, t, chunk, rtol, atol):
    """Value and both gradients of the chunked loss (jitted) against the plain one."""
    chunked = jax.jit(jax.value_and_grad(lambda h, e: cross_entropy(h, e, t, chunk_size=chunk), (0, 1)))
    plain = jax.value_and_grad(lambda h, e: plain_cross_entropy(h, e, t), (0, 1))
    (got, got_grads), (want, want_grads) = chunked(h, e), plain(h, e)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=rtol)
    for g, w, x in zip(got_grads, want_grads, (h, e), strict=True):
        assert g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype,rtol,atol", [(jnp.float32, 1e-5, 1e-7), (jnp.bfloat16, 2e-2, 2e-4)])
def test_gathered_target_logit_equals_plain(dtype, rtol, atol):
    """The target logit by a gather of the target rows (outside the vocabulary scan) in float32 and bf16."""
    kh, ke, kt = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(kh, (4, 16, 32)).astype(dtype)
    e = (0.3 * jax.random.normal(ke, (200, 32))).astype(dtype)
    t = jax.random.randint(kt, (4, 16), 0, 200)
    _check_against_plain(h, e, t, 64, rtol, atol)


def test_duplicate_targets_add_up():
    """Many tokens with the same target: every one of them contributes to that embedding row's gradient."""
    kh, ke, kt = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(kh, (48, 16))
    e = 0.3 * jax.random.normal(ke, (70, 16))
    t = jnp.where(jax.random.bernoulli(kt, 0.75, (48,)), 5, jnp.arange(48) % 70)
    _check_against_plain(h, e, t, 32, 1e-5, 1e-7)


def test_targets_in_the_padded_last_chunk():
    """Targets among the last chunk's real ids (96..99 of vocab 100 in chunks of 32, 28 padded columns)."""
    kh, ke = jax.random.split(jax.random.key(4))
    h = jax.random.normal(kh, (12, 16))
    e = 0.3 * jax.random.normal(ke, (100, 16))
    t = 96 + jnp.arange(12) % 4
    _check_against_plain(h, e, t, 32, 1e-5, 1e-7)


def test_logits_of_magnitude_1e4_do_not_overflow():
    """Logits spread over +-1e4, the running max jumping by thousands from chunk to chunk: finite and exact."""
    kh, ke, kt = jax.random.split(jax.random.key(5), 3)
    h = jax.random.normal(kh, (32, 8))
    e = 1e4 / 3 * jax.random.normal(ke, (300, 8)) / jnp.sqrt(8.0)
    t = jax.random.randint(kt, (32,), 0, 300)
    logits = h @ e.T
    assert 5e3 < float(jnp.max(jnp.abs(logits))) < 2e4
    _check_against_plain(h, e, t, 64, 1e-5, 1e-6)
