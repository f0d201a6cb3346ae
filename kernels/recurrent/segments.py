"""Packed documents inside a chunk: the masks the recurrent kernels apply when given ``segment_ids``.

Each row carries ``rel`` (``reference.chunk_segments``): its document counted from the one the chunk carries in
(0: the row continues the carried state). The segment-aware chunk form (``reference.chunked_recurrence``) then
keeps, of the chunk's products:

- the decayed Gram products (``A``, the output's ``P``) only for pairs in one document, so ``(I + A)`` is block
  diagonal per document and its inverse exact;
- the start-state terms (``Q exp(gamma) h``, ``w = T (beta exp(gamma) K)``) only on rows of the carried document;
- the state update's sum only over rows of the chunk's last document, and the decay of ``h`` only if that is the
  carried document.

The gate's cumulative sums are untouched (every exponent kept is a difference within one document). A mask is a
``jnp.where`` on a factor that is at most 1 (or on a product of such factors), so nothing masked can overflow
or turn into NaN. Without ``segment_ids`` no kernel calls anything here (the kernels' IR is unchanged).

The chunk-parallel kernels get ``rel`` only on the chunks where a new document starts (and on the rare chunks
the levels launch redoes): ``launch.diagonal_launches`` runs every other chunk through the kernel without it.
The sequential state passes, whose every instruction is on the chain from one chunk to the next, read instead
per-row codes that XLA derives from ``rel`` (:func:`row_codes`): :class:`RowDocuments` needs one reduction per
chunk, at the end of its work, and each of its masks one compare, in the orientation it is used in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


class Documents:
    """The document structure of one chunk, from the row blocks ``rel`` (``[S]`` int32 each) of its ``rel`` ref."""

    def __init__(self, rel: list[jax.Array]):
        self.rel = rel
        self.last = jnp.max(rel[-1])  # the chunk's last document (rel is nondecreasing along rows)

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


def load(ref, blocks) -> Documents | None:
    """:class:`Documents` of a chunk's ``rel`` ref (``[C]``), split by ``blocks(ref)``; ``None`` for no ref."""
    return None if ref is None else Documents(blocks(ref))


def pairs(m: list[list[jax.Array]], docs: Documents | None) -> list[list[jax.Array]]:
    """A lower block-triangular ``m[i][j]`` with the pairs in two documents set to 0 (``docs`` None: ``m``)."""
    if docs is None:
        return m
    return [[jnp.where(docs.same(i, j), x, 0.0) for j, x in enumerate(row)] for i, row in enumerate(m)]


def carried(x: jax.Array, docs: Documents | None, i: int = 0) -> jax.Array:
    """Row factor ``x`` (``[S, 1]`` or ``[S, K]``) of block ``i``, 0 on rows outside the carried document."""
    return x if docs is None else jnp.where(docs.carried(i), x, 0.0)


def in_last(x: jax.Array, docs: Documents | None, i: int = 0) -> jax.Array:
    """Row factor ``x`` of block ``i``, 0 on rows outside the chunk's last document."""
    return x if docs is None else jnp.where(docs.in_last(i), x, 0.0)


def start_decay(x: jax.Array, docs: Documents | None) -> jax.Array:
    """The start state's decay factor ``x`` (any shape), 0 where the chunk ends in a new document."""
    return x if docs is None else jnp.where(docs.ends_carried(), x, 0.0)


def row_codes(rel: jax.Array, C: int) -> jax.Array:
    """XLA: the documents of ``rel [B, T]`` (``reference.chunk_segments``, chunks of ``C`` rows) as the sequential
    passes read them: ``[B, T]`` int32 per row, ``4 * start + 2 * in_last + carried`` (``start``: the row of the
    chunk where the row's document begins, 0 for the carried one; ``in_last``: the row is in the chunk's last
    document; ``carried``: it continues the carried state)."""
    B, T = rel.shape
    r = rel.reshape(B, T // C, C)
    row = jnp.arange(C, dtype=jnp.int32)
    begins = jnp.concatenate([jnp.ones_like(r[..., :1], bool), r[..., 1:] != r[..., :-1]], axis=-1)
    start = lax.cummax(jnp.where(begins, row, 0), axis=2)
    code = 4 * start + 2 * (r == r[..., -1:]).astype(jnp.int32) + (r == 0).astype(jnp.int32)
    return code.reshape(B, T)


class RowDocuments:
    """The document structure of one chunk of a sequential pass, from its rows' codes (``[C]`` int32, loaded with
    the chunk's rows) of :func:`row_codes`; the interface of :class:`Documents` for one block."""

    def __init__(self, code: jax.Array):
        self.code = code

    def carried(self, i: int = 0) -> jax.Array:
        return ((self.code & 1) != 0)[:, None]

    def in_last(self, i: int = 0) -> jax.Array:
        return ((self.code & 2) != 0)[:, None]

    def ends_carried(self) -> jax.Array:
        """Scalar bool: the chunk's last row continues the carried state (one reduction, at the end of the chunk's
        work)."""
        last = lax.broadcasted_iota(jnp.int32, self.code.shape, 0) == self.code.shape[0] - 1
        return jnp.max(jnp.where(last, self.code & 1, 0)) > 0

    def same_as_later(self, C: int) -> jax.Array:
        """``[C, C]`` bool, for pairs ``a <= b`` (row ``a``, column ``b``): row ``a`` is in column ``b``'s document."""
        return lax.broadcasted_iota(jnp.int32, (C, C), 0) >= (self.code >> 2)[None, :]


def load_rows(code_ref, rows) -> RowDocuments | None:
    """:class:`RowDocuments` of the rows ``rows`` (one chunk) of a sequential pass's ``code_ref [T]``; None for no
    ref."""
    return None if code_ref is None else RowDocuments(code_ref[rows])
