"""Packed documents inside a chunk: the masks the recurrent kernels apply when given ``segment_ids``.

Each row carries ``rel`` (``reference.chunk_segments``): its document counted from the one the chunk carries in
(0: the row continues the carried state). The segment-aware chunk form (``reference.chunked_recurrence``) then
keeps, of the chunk's products:

- the decayed Gram products (``A``, the output's ``P``) only for pairs in one document, so ``(I + A)`` is block
  diagonal per document and its inverse exact;
- the start-state terms (``Q exp(gamma) h``, ``w = T (beta exp(gamma) K)``) only on rows of the carried document;
- the state update's sum only over rows of the chunk's last document, and the decay of ``h`` only if that is the
  carried document.

The gate's cumulative sums are untouched (every exponent kept is a difference within one document). Every value
a mask zeroes is finite for finite inputs: a factor that is at most 1 (or capped: ``block_math.cross_factors``), a
product of such factors with the inputs, or a product of finite gradients, so nothing masked can overflow or turn
into NaN. With the scalar gate a mask is a ``jnp.where``; with the per-key gate (KDA) it is a product with the 0/1
mask, which the Triton compiler fits in fewer registers there (:class:`Documents`), so a NaN input of one document
also reaches the others of its chunk (the step is then skipped either way). Without ``segment_ids`` the kernels' IR is
the one without documents (:func:`loop_over_chunks` is then a plain ``fori_loop``).

The sequential state passes apply no row mask: they take ``q`` zeroed outside each chunk's carried document and
``k`` zeroed outside its last one (:func:`sequential_qk`, XLA; ``w`` is zero there already, from the masked
``wy``), and the reverse pass takes the forward's masked ``P``; on the sequential chain only the start state's
decay follows the documents, through one bit per chunk (:func:`chunk_keeps`), all loaded before the loop
(:func:`loop_over_chunks`), so that no load of the documents is on it. Without the delta rule
(Mamba2's SSD) the reverse pass instead masks ``q``, ``k`` (on their rows' decay factors) and its recomputed
``P`` itself from each chunk's ``rel`` (``backward.state_bwd``): there the masks feed no ``w`` term and so stay
off the chain, and no ``P`` is written and read.

The chunk-parallel kernels take ``rel`` in their first launch (``launch.diagonal_launches``): per table
(``RecurrentConfig.documents_branch``) each program either runs the kernel with it only on a chunk where a new
document starts, and without it on the others, or with it on every chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hybrid_jax.kernels.recurrent import block_math as bm


class Documents:
    """The document structure of one chunk, from the row blocks ``rel`` (``[S]`` int32 each) of its ``rel`` ref.
    ``product``: masks multiply by the 0/1 mask instead of selecting (the per-key gate's kernels, where the Triton
    compiler gives the gradient launch fewer registers for a product than for a select)."""

    def __init__(self, rel: list[jax.Array], product: bool):
        self.rel = rel
        self.product = product
        self.last = jnp.max(rel[-1])  # the chunk's last document (rel is nondecreasing along rows)

    def mask(self, x: jax.Array, keep: jax.Array) -> jax.Array:
        """``x`` where the bool ``keep`` (broadcast to ``x``) holds, else 0."""
        return x * keep.astype(x.dtype) if self.product else jnp.where(keep, x, 0.0)

    def same(self, i: int, j: int) -> jax.Array:
        """``[S, S]`` bool: rows of block ``i`` and of block ``j`` in one document."""
        return self.rel[i][:, None] == self.rel[j][None, :]

    def carried(self, i: int) -> jax.Array:
        """``[S, 1]`` bool: the rows of block ``i`` that continue the carried state."""
        return (self.rel[i] == 0)[:, None]

    def in_last(self, i: int) -> jax.Array:
        """``[S, 1]`` bool: the rows of block ``i`` in the chunk's last document."""
        return (self.rel[i] == self.last)[:, None]

    def ends_carried(self) -> jax.Array:
        """Scalar bool: the chunk ends in the carried document (the start state's decay is kept)."""
        return self.last == 0


def load(ref, per_key: bool) -> Documents | None:
    """:class:`Documents` of a chunk's ``rel`` ref (``[C]``), in the row blocks of ``block_math.blocks``, masking by
    product with a per-key gate; ``None`` for no ref."""
    return None if ref is None else Documents(bm.blocks(ref, per_key), product=per_key)


def pairs(m: list[list[jax.Array]], docs: Documents | None) -> list[list[jax.Array]]:
    """A lower block-triangular ``m[i][j]`` with the pairs in two documents set to 0 (``docs`` None: ``m``)."""
    if docs is None:
        return m
    return [[docs.mask(x, docs.same(i, j)) for j, x in enumerate(row)] for i, row in enumerate(m)]


def carried(x: jax.Array, docs: Documents | None, i: int = 0) -> jax.Array:
    """Row factor ``x`` (``[S, 1]`` or ``[S, K]``) of block ``i``, 0 on rows outside the carried document."""
    return x if docs is None else docs.mask(x, docs.carried(i))


def in_last(x: jax.Array, docs: Documents | None, i: int = 0) -> jax.Array:
    """Row factor ``x`` of block ``i``, 0 on rows outside the chunk's last document."""
    return x if docs is None else docs.mask(x, docs.in_last(i))


def start_decay(x: jax.Array, docs: Documents | None) -> jax.Array:
    """The start state's decay factor ``x`` (any shape), 0 where the chunk ends in a new document."""
    return x if docs is None else jnp.where(docs.ends_carried(), x, 0.0)


def sequential_qk(q: jax.Array, k: jax.Array, rel: jax.Array | None, C: int) -> tuple[jax.Array, jax.Array]:
    """XLA: ``q, k [B,T,H,K]`` as the sequential state passes take them: with packed documents (``rel [B,T]``,
    chunks of ``C`` rows) ``q`` zero on rows outside their chunk's carried document (the start-state term ``Q
    exp(gamma) h`` keeps only those rows) and ``k`` zero on rows outside their chunk's last document (the state
    update's sum keeps only those); ``rel`` None: ``q`` and ``k`` themselves."""
    if rel is None:
        return q, k
    B, T = rel.shape
    chunks = rel.reshape(B, T // C, C)
    in_last = (chunks == chunks[:, :, -1:]).reshape(B, T)[:, :, None, None]
    carried = (rel == 0)[:, :, None, None]
    return jnp.where(carried, q, jnp.zeros_like(q)), jnp.where(in_last, k, jnp.zeros_like(k))


def chunk_keeps(rel: jax.Array, C: int) -> jax.Array:
    """XLA: ``[B, W]`` int32 bit words: bit ``r`` of word ``w`` is 1 where chunk ``32 w + r`` (of ``C`` rows of ``rel
    [B,T]``) ends in its carried document (the start state's decay is kept); ``W`` is a power of two, the words past
    the last chunk are 0."""
    B, T = rel.shape
    N = T // C
    W = pl.next_power_of_2(-(-N // 32))  # words of 32 chunks' bits
    keep = (rel.reshape(B, N, C)[:, :, -1] == 0).astype(jnp.uint32)
    keep = jnp.pad(keep, ((0, 0), (0, 32 * W - N))).reshape(B, W, 32)
    words = jnp.sum(keep << jnp.arange(32, dtype=jnp.uint32), axis=2, dtype=jnp.uint32)  # distinct bits: an OR
    return lax.bitcast_convert_type(words, jnp.int32)


def loop_over_chunks(body: Callable, n_chunks: int, init: jax.Array, keep_ref=None, reverse: bool = False
                     ) -> jax.Array:
    """``lax.fori_loop`` of ``body(step, state, keep)`` over ``n_chunks`` steps from ``init`` -> the final state.
    ``keep``: None without ``keep_ref``; else the step's chunk's :func:`chunk_keeps` bit (an int32 scalar; the
    chunk of step ``i`` is ``i``, or ``N - 1 - i`` with ``reverse``). The words (``keep_ref [W]``) are loaded once,
    before the loop, and a step picks its bit with a select and a sum over ``W`` (a few words: no shared memory)
    and two shifts, so that the step waits on no load."""
    if keep_ref is None:
        return lax.fori_loop(0, n_chunks, lambda i, state: body(i, state, None), init)
    words = keep_ref[...]
    index = lax.broadcasted_iota(jnp.int32, words.shape, 0)

    def step(i, state):
        c = n_chunks - 1 - i if reverse else i
        word = jnp.sum(jnp.where(index == c >> 5, words, 0))  # c // 32, c % 32 (c >= 0)
        return body(i, state, (word >> (c & 31)) & 1)

    return lax.fori_loop(0, n_chunks, step, init)


def kept(decay: jax.Array, keep: jax.Array | None) -> jax.Array:
    """The start state's decay factor ``decay``, 0 where ``keep`` (a :func:`chunk_keeps` bit; None: kept) is 0."""
    return decay if keep is None else jnp.where(keep > 0, decay, 0.0)
