"""Next-token cross-entropy from the final hidden states and the tied embedding, in vocabulary chunks.

The logits ``h @ E^T`` of a whole batch are ``[tokens, vocab]``: at the 300M recipe (32 x 2048 tokens,
vocabulary 128,256) that is 31 GiB in float32, more than the rest of the step. Here the vocabulary is cut
into chunks of ``chunk_size`` rows of ``E``; the forward pass keeps a running (online) log-sum-exp per token
(the target logits come from a gather of the target rows of ``E``, not from the chunks), and a custom VJP
recomputes each chunk's logits in the backward pass, so at most ``[tokens, chunk_size]`` logits exist at any
time. The matmuls run in the dtype of ``h`` (the compute dtype) with float32 accumulation; the log-sum-exp and
the softmax are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def cross_entropy(h: jax.Array, embedding: jax.Array, targets: jax.Array, *, chunk_size: int) -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``softmax(h @ embedding^T)`` against ``targets``.

    Args:
      h: ``[..., D]`` hidden states (any float dtype; the matmuls run in it).
      embedding: ``[V, D]`` the tied embedding (cast to ``h.dtype`` for the matmuls).
      targets: ``[...]`` int token ids in ``[0, V)``.
      chunk_size: vocabulary rows per chunk (the last chunk is padded and masked).
    Returns:
      float32 scalar: the mean over all target tokens.
    """
    d = h.shape[-1]
    v = embedding.shape[0]
    n_chunks = -(-v // chunk_size)
    e = embedding.astype(h.dtype)
    e = jnp.pad(e, ((0, n_chunks * chunk_size - v), (0, 0))).reshape(n_chunks, chunk_size, d)
    return _chunked_ce(h.reshape(-1, d), e, targets.reshape(-1).astype(jnp.int32), v)


def plain_cross_entropy(h: jax.Array, embedding: jax.Array, targets: jax.Array) -> jax.Array:
    """The same loss with full float32 logits (the reference the chunked form is tested against)."""
    logits = jnp.einsum("...d,vd->...v", h, embedding.astype(h.dtype), preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1))


def _chunk_logits(h: jax.Array, e_chunk: jax.Array, index: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Float32 logits ``[N, C]`` of one vocabulary chunk, padded columns set to -inf; and their ids ``[C]``."""
    ids = index * e_chunk.shape[0] + jnp.arange(e_chunk.shape[0])
    logits = jnp.einsum("nd,cd->nc", h, e_chunk, preferred_element_type=jnp.float32)
    return jnp.where(ids[None, :] < vocab, logits, -jnp.inf), ids


def _forward(h: jax.Array, e: jax.Array, vocab: int) -> jax.Array:
    """Per-token log-sum-exp ``[N]`` by a scan over the chunks of ``e [n, C, D]``: one max pass and one exp-sum pass
    over each chunk's logits, merged into the running ``(max, sum of exp)``."""
    n = h.shape[0]

    def body(carry, xs):
        m, s = carry
        e_chunk, index = xs
        logits, _ = _chunk_logits(h, e_chunk, index, vocab)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=-1)
        return (m_new, s), None

    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    (m, s), _ = jax.lax.scan(body, init, (e, jnp.arange(e.shape[0])))
    return m + jnp.log(s)


def _target_logits(h: jax.Array, e: jax.Array, targets: jax.Array) -> jax.Array:
    """``[N]`` float32 logit of each token's target: its row of ``e [n, C, D]`` gathered, the product in ``h``'s
    dtype with float32 accumulation like the chunk matmuls."""
    return jnp.einsum("nd,nd->n", h, e.reshape(-1, h.shape[-1])[targets], preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_ce(h: jax.Array, e: jax.Array, targets: jax.Array, vocab: int) -> jax.Array:
    return jnp.mean(_forward(h, e, vocab) - _target_logits(h, e, targets))


def _chunked_ce_fwd(h, e, targets, vocab):
    lse = _forward(h, e, vocab)
    return jnp.mean(lse - _target_logits(h, e, targets)), (h, e, targets, lse)


def _chunked_ce_bwd(vocab, res, g):
    """Per chunk: ``dlogits = (softmax - onehot) g / N``; ``dh += dlogits E_c``; ``dE_c = dlogits^T h``.

    The ``- onehot`` stays in the chunk's elementwise pass (fused, no extra memory traffic): subtracting
    ``g / N E[targets]`` after the matmuls instead cancels the bf16-rounded target probability against 1 and loses
    the gradient of confident tokens (relative error ~1 where the target probability is near 1).
    """
    h, e, targets, lse = res
    scale = g / h.shape[0]

    def body(dh, xs):
        e_chunk, index = xs
        logits, ids = _chunk_logits(h, e_chunk, index, vocab)
        dlogits = (jnp.exp(logits - lse[:, None]) - (ids[None, :] == targets[:, None])) * scale
        dlogits = dlogits.astype(h.dtype)
        dh = dh + jnp.einsum("nc,cd->nd", dlogits, e_chunk, preferred_element_type=jnp.float32)
        de = jnp.einsum("nc,nd->cd", dlogits, h, preferred_element_type=jnp.float32)
        return dh, de.astype(e.dtype)

    dh, de = jax.lax.scan(body, jnp.zeros(h.shape, jnp.float32), (e, jnp.arange(e.shape[0])))
    return dh.astype(h.dtype), de, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)
