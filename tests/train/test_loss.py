"""The token-chunked cross-entropy equals the plain one (values and gradients), never builds full logits, and gets
its gradient from the forward pass (three logits-sized matmuls, not four)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.train.step.loss import cross_entropy, plain_cross_entropy


@pytest.mark.parametrize("vocab,chunk", [(96, 4), (100, 5), (50, 15), (50, 64)])
def test_chunked_equals_plain_float32(vocab, chunk):
    """15 tokens in chunks of 4 (ragged last chunk), 5 (exact), 15 (one chunk) and 64 (one padded chunk)."""
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
    got = cross_entropy(h.astype(jnp.bfloat16), e, t, chunk_size=24)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=2e-2)


def test_bfloat16_logits_are_stored_rounded_and_read_in_float32():
    """In bf16 the logits are kept in bf16 (as FLA's fused cross-entropy keeps them; half the bytes of the memory-
    bound passes over [chunk, vocab]): the loss and dh are those of the rounded logits, with the log-sum-exp, the
    softmax and the target logit in float32; against full float32 logits the loss moves by about bf16's rounding."""
    kh, ke, kt = jax.random.split(jax.random.key(6), 3)
    h = jax.random.normal(kh, (2, 40, 32)).astype(jnp.bfloat16)
    e = (0.5 * jax.random.normal(ke, (300, 32))).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (2, 40), 0, 300)
    f32 = jnp.einsum("btd,vd->btv", h, e, preferred_element_type=jnp.float32)
    target = jnp.take_along_axis(f32, t[..., None], axis=-1)[..., 0]

    def rounded_loss(h):  # the reference: logits rounded to bf16, everything after them float32
        logits = jnp.einsum("btd,vd->btv", h, e, preferred_element_type=jnp.float32)
        target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        logits = logits + jax.lax.stop_gradient(logits.astype(jnp.bfloat16).astype(jnp.float32) - logits)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

    loss, dh = jax.value_and_grad(lambda h: cross_entropy(h, e, t, chunk_size=24))(h)
    want, want_dh = jax.value_and_grad(rounded_loss)(h.astype(jnp.float32))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    exact = jnp.mean(jax.nn.logsumexp(f32, axis=-1) - target)
    assert 1e-6 < abs(float(loss - exact)) < 2e-3  # the rounding shows, and stays at bf16's scale
    np.testing.assert_allclose(np.asarray(dh, np.float32), want_dh, rtol=2e-2, atol=2e-5)  # dh is rounded to bf16


def test_no_full_logits_in_the_compiled_program():
    """No [tokens, vocab] float32 buffer: the largest intermediate is a [chunk, vocab] block."""
    n, d, v, chunk = 256, 16, 4096, 32
    h, e, t = jnp.ones((n, d)), jnp.ones((v, d)), jnp.zeros((n,), jnp.int32)
    grad = jax.jit(jax.grad(lambda h, e: cross_entropy(h, e, t, chunk_size=chunk), (0, 1)))
    text = grad.lower(h, e).as_text()
    assert f"tensor<{n}x{v}xf32>" not in text
    assert f"tensor<{chunk}x{v}xf32>" in text


def test_gradient_costs_three_logits_matmuls():
    """The gradient comes from the forward pass: the compiled value-and-gradient has three matmuls (logits, dh, dE);
    a backward pass that recomputed the logits would add a fourth."""
    n, d, v = 256, 64, 4096
    h, e, t = jnp.ones((n, d)), jnp.ones((v, d)), jnp.zeros((n,), jnp.int32)
    grad = jax.jit(jax.value_and_grad(lambda h, e: cross_entropy(h, e, t, chunk_size=n // 4), (0, 1)))
    text = grad.lower(h, e).compile().as_text()
    dots = [line for line in text.splitlines() if re.search(r"= \S+ dot\(", line)]
    assert len(dots) == 3, dots


def test_cotangent_scales_the_gradient():
    """The backward rule scales the gradient built in the forward pass by the incoming cotangent."""
    kh, ke, kt = jax.random.split(jax.random.key(6), 3)
    h = jax.random.normal(kh, (20, 16))
    e = 0.3 * jax.random.normal(ke, (40, 16))
    t = jax.random.randint(kt, (20,), 0, 40)
    grads = jax.grad(lambda h, e: -2.5 * cross_entropy(h, e, t, chunk_size=8), (0, 1))(h, e)
    plain = jax.grad(lambda h, e: -2.5 * plain_cross_entropy(h, e, t), (0, 1))(h, e)
    for g, w in zip(grads, plain, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


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
    _check_against_plain(h, e, t, 24, rtol, atol)


def test_duplicate_targets_add_up():
    """Many tokens with the same target: every one of them contributes to that embedding row's gradient."""
    kh, ke, kt = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(kh, (48, 16))
    e = 0.3 * jax.random.normal(ke, (70, 16))
    t = jnp.where(jax.random.bernoulli(kt, 0.75, (48,)), 5, jnp.arange(48) % 70)
    _check_against_plain(h, e, t, 32, 1e-5, 1e-7)


def test_padded_tokens_of_the_last_chunk_weigh_nothing():
    """13 tokens in chunks of 4: the last chunk's 3 padded tokens (target 0) change neither loss nor gradients,
    also with the real tokens' targets at the vocabulary's ends."""
    kh, ke = jax.random.split(jax.random.key(4))
    h = jax.random.normal(kh, (13, 16))
    e = 0.3 * jax.random.normal(ke, (100, 16))
    t = jnp.where(jnp.arange(13) % 2 == 0, 0, 99)
    _check_against_plain(h, e, t, 4, 1e-5, 1e-7)


def test_logits_of_magnitude_1e4_do_not_overflow():
    """Logits spread over +-1e4 (rows whose maxima differ by thousands): finite and exact."""
    kh, ke, kt = jax.random.split(jax.random.key(5), 3)
    h = jax.random.normal(kh, (32, 8))
    e = 1e4 / 3 * jax.random.normal(ke, (300, 8)) / jnp.sqrt(8.0)
    t = jax.random.randint(kt, (32,), 0, 300)
    logits = h @ e.T
    assert 5e3 < float(jnp.max(jnp.abs(logits))) < 2e4
    _check_against_plain(h, e, t, 12, 1e-5, 1e-6)
