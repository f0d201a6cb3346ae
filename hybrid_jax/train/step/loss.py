"""Next-token cross-entropy from the final hidden states and the output matrix (the tied embedding, or the untied
``lm_head``), in chunks of tokens, with its gradient computed in the forward pass.

The logits ``h @ E^T`` of a whole batch are ``[tokens, vocab]``: at the 300M recipe (32 x 2048 tokens,
vocabulary 128,256) that is 31 GiB in float32, more than the rest of the step. Here the tokens are cut into
chunks of ``chunk_size``; each chunk's logits ``[chunk_size, vocab]`` exist only inside one step of a scan.

Under differentiation (the custom VJP's forward rule) the same pass also builds the gradient, as FLA's fused
linear cross-entropy does: with a chunk's full-vocabulary logits at hand its log-sum-exp is known, so
``dlogits = (softmax - onehot) / N`` follows at once, and ``dh = dlogits E`` and ``dE += dlogits^T h`` are taken
there; the backward rule only scales them by the incoming cotangent. Against recomputing the logits in the
backward pass this saves one of the four ``[tokens, vocab, D]`` matmuls and one write of the logits per step.
Without differentiation (evaluation) only the log-sum-exp is computed.

The matmuls run in the dtype of ``h`` (the compute dtype) with float32 accumulation, and the logits are stored in
that dtype, as FLA's fused linear cross-entropy keeps them: the element-wise passes over ``[chunk, vocab]`` (the
log-sum-exp's two reductions, ``dlogits``) are memory-bound, and bfloat16 logits halve them (benchmarks/NOTES.md).
The log-sum-exp and the softmax are computed in float32 from them; ``dlogits`` is rounded to ``h``'s dtype for its
two matmuls, with the ``- onehot`` applied before that rounding (subtracting it afterwards would cancel the
rounded target probability against 1 and lose the gradient of confident tokens). On a GPU one Pallas kernel computes
the log-sum-exp and ``dlogits`` in two passes over the logits instead of XLA's three
(:mod:`hybrid_jax.kernels.cross_entropy`). The target logit is a float32 dot product of ``h`` and its target row,
not read from the rounded logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.kernels.cross_entropy import softmax_grad

F32 = jnp.float32


def cross_entropy(h: jax.Array, embedding: jax.Array, targets: jax.Array, *, chunk_size: int,
                  impl: str = "auto") -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``softmax(h @ embedding^T)`` against ``targets``.

    Args:
      h: ``[..., D]`` hidden states (any float dtype; the matmuls run in it).
      embedding: ``[V, D]`` the output matrix, ``HybridLM.output_embedding`` (cast to ``h.dtype`` for the matmuls).
      targets: ``[...]`` int token ids in ``[0, V)``.
      chunk_size: tokens per chunk (the last chunk is padded; padded tokens weigh 0).
      impl: the softmax-gradient kernel's, as ``model.kernel_impl`` (:mod:`hybrid_jax.kernels.cross_entropy`).
    Returns:
      float32 scalar: the mean over all target tokens.
    """
    d = h.shape[-1]
    h = h.reshape(-1, d)
    targets = targets.reshape(-1).astype(jnp.int32)
    n = h.shape[0]
    n_chunks = -(-n // chunk_size)
    pad = n_chunks * chunk_size - n
    weight = jnp.pad(jnp.full((n,), 1.0 / n, F32), (0, pad)).reshape(n_chunks, chunk_size)
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, d)
    targets = jnp.pad(targets, (0, pad)).reshape(n_chunks, chunk_size)
    return _chunked_ce(h, embedding.astype(h.dtype), targets, weight, impl)


def model_loss(model: nnx.Module, inputs: jax.Array, targets: jax.Array, segment_ids: jax.Array | None, *,
               chunk_size: int, context: str | None = None) -> jax.Array:
    """Mean next-token cross-entropy of ``model`` (a ``HybridLM``) reading ``inputs [B,T]`` against ``targets [B,T]``
    (``segment_ids [B,T]``: packed documents; ``context``: inside its ``shard_map``, the mesh axis the time axis is
    split over, the arrays then this shard's part); float32 scalar."""
    h = model.features(inputs, segment_ids, context=context)
    return cross_entropy(h, jnp.asarray(model.output_embedding), targets, chunk_size=chunk_size,
                         impl=model.kernel_impl)


def plain_cross_entropy(h: jax.Array, embedding: jax.Array, targets: jax.Array) -> jax.Array:
    """The same loss with full float32 logits (the reference the chunked form is tested against)."""
    logits = jnp.einsum("...d,vd->...v", h, embedding.astype(h.dtype), preferred_element_type=F32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1))


def _logits(h: jax.Array, e: jax.Array) -> jax.Array:
    """Logits ``[C, V]`` of one chunk ``h [C, D]``: accumulated in float32, stored in ``h``'s dtype (read as float32
    by the passes over them)."""
    return jnp.einsum("cd,vd->cv", h, e, preferred_element_type=h.dtype)


def _loss(h: jax.Array, e: jax.Array, targets: jax.Array, weight: jax.Array, lse: jax.Array) -> jax.Array:
    """``sum(weight * (lse - target logit))``; the target logits by a gather of the target rows of ``e``, the
    product in ``h``'s dtype with float32 accumulation like the chunk matmuls. ``h [n, C, D]``, the rest ``[n, C]``."""
    target_logits = jnp.einsum("ncd,ncd->nc", h, e[targets], preferred_element_type=F32)
    return jnp.sum(weight * (lse - target_logits))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_ce(h: jax.Array, e: jax.Array, targets: jax.Array, weight: jax.Array, impl: str) -> jax.Array:
    """``h [n, C, D]``, ``e [V, D]``, ``targets [n, C]``, ``weight [n, C]`` (1/N, 0 on padding) -> the loss;
    ``impl``: the softmax-gradient kernel's (:func:`hybrid_jax.kernels.cross_entropy.softmax_grad`)."""
    lse = jax.lax.map(lambda h_c: jax.nn.logsumexp(_logits(h_c, e).astype(F32), axis=-1), h)
    return _loss(h, e, targets, weight, lse)


def _chunked_ce_fwd(h, e, targets, weight, impl):
    """The loss and, per chunk, ``dlogits = weight (softmax - onehot)``, ``dh = dlogits E``, ``dE += dlogits^T h``."""

    def body(de, xs):
        h_c, t_c, w_c = xs
        dlogits, lse = softmax_grad(_logits(h_c, e), t_c, w_c, impl=impl)
        dh = jnp.einsum("cv,vd->cd", dlogits, e, preferred_element_type=F32).astype(h.dtype)
        return de + jnp.einsum("cv,cd->vd", dlogits, h_c, preferred_element_type=F32), (lse, dh)

    de, (lse, dh) = jax.lax.scan(body, jnp.zeros(e.shape, F32), (h, targets, weight))
    return _loss(h, e, targets, weight, lse), (dh, de.astype(e.dtype))


def _chunked_ce_bwd(impl, res, g):
    dh, de = res
    return (g * dh).astype(dh.dtype), (g * de).astype(de.dtype), None, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)
