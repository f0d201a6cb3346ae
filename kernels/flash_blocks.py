"""Tile pieces shared by the flash attention kernels (forward: :mod:`hybrid_jax.kernels.flash_attention`; dK/dV and dQ:
:mod:`hybrid_jax.kernels.flash_attention_bwd`): what a launch is specialised on, block sizes and padded lengths,
masked loads and stores, the scores and their masks, the ranges of blocks a program visits, one ``pallas_call``.

Queries ``[B,Tq,...]`` are the tokens at positions ``offset .. offset + Tq - 1`` of the keys' sequence
``[B,Tk,...]``. Self-attention (``Tq == Tk``, offset 0) knows its offset statically (``offset=None`` below: the
kernels are those of before the offset existed). Otherwise (a context shard's queries over the whole sequence's keys)
the offset is a traced int32 scalar operand: the causal mask compares ``offset + row`` with each key's position and
every block range shifts by it, so a program still visits only the key blocks at or below its last row's position.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning

LOG2E = math.log2(math.e)
MASKED = -1e30  # finite, so that a fully masked row never makes inf - inf


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the kernels are specialised on (hashable: a ``custom_vjp`` non-differentiable argument)."""

    causal: bool
    scale: float
    config: tuning.AttentionConfig
    interpret: bool
    documents: bool = False  # document bounds follow the operands (packed documents)
    offset: bool = False  # the queries' offset (an int32 scalar operand) comes before the document bounds


@dataclasses.dataclass(frozen=True)
class Documents:
    """Document bounds as a kernel sees them: each token's document's first and last position in the keys'
    sequence, for the query rows (``q_start, q_end: [Tqp]`` int32 refs) and the key rows (``k_start, k_end: [Tkp]``)."""

    q_start: object
    q_end: object
    k_start: object
    k_end: object


def optional_refs(static: Static, refs) -> tuple[jax.Array | None, Documents | None]:
    """A kernel's optional operands: ``(offset, documents)``. ``offset``: read from ``offset_ref: []`` int32, or
    ``None`` (statically 0); the bounds: ``q_start, q_end, k_start, k_end`` with an offset, else one ``start, end``
    pair (``[Tp]``) for both sides."""
    refs = list(refs)
    offset = refs.pop(0)[()] if static.offset else None
    if not static.documents:
        return offset, None
    return offset, Documents(*refs) if static.offset else Documents(*refs, *refs)


def pow2(n: int) -> int:
    """Next power of two, at least 16 (the smallest Triton dot)."""
    return max(16, pl.next_power_of_2(n))


def blocks(kc: tuning.AttentionKernel, q_len: int, k_len: int) -> tuple[int, int]:
    """A kernel's (block_q, block_k), shrunk for short sequences."""
    return min(kc.block_q, pow2(q_len)), min(kc.block_k, pow2(k_len))


def padded_len(static: Static, length: int, q_len: int, k_len: int) -> int:
    """``length`` (``q_len`` or ``k_len``) rounded up to a multiple of every block of every kernel: the length of the
    row statistics (lse, delta: queries) and of the document bounds, and the rows of a sequence operand's block."""
    c = static.config
    step = max(b for kc in (c.fwd, c.dkdv, c.dq) for b in blocks(kc, q_len, k_len))
    return pl.cdiv(length, step) * step


# ---------------------------------------------------------------------------------------------- loads and stores


def _row_col_mask(ref, start, rows: int, seq_len: int, width: int) -> jax.Array | None:
    """Mask of rows ``< seq_len`` and columns ``< width`` of a ``[rows, Dpad]`` tile; ``None`` when all are in."""
    mask = None
    if seq_len % rows:
        mask = (start + jnp.arange(rows) < seq_len)[:, None]
    if width != ref.shape[-1]:
        cols = (jnp.arange(ref.shape[-1]) < width)[None, :]
        mask = cols if mask is None else mask & cols
    return mask


def load_rows(ref, start, rows: int, seq_len: int, width: int) -> jax.Array:
    """Rows ``[start, start+rows)`` of a ``[Tp, Dpad]`` block ref, zero past ``seq_len`` and past column ``width``."""
    mask = _row_col_mask(ref, start, rows, seq_len, width)
    if mask is None:
        return ref[pl.ds(start, rows), :]
    return pltriton.load(ref.at[pl.ds(start, rows), :], mask=mask, other=0.0)


def store_rows(ref, start, x: jax.Array, seq_len: int, width: int) -> None:
    mask = _row_col_mask(ref, start, x.shape[0], seq_len, width)
    pltriton.store(ref.at[pl.ds(start, x.shape[0]), :], x.astype(ref.dtype), mask=mask)


def load_stat(ref, start, rows: int, seq_len: int) -> jax.Array:
    """Row statistics (lse or delta) of rows ``[start, start+rows)``; zero past ``seq_len``."""
    if seq_len % rows == 0:
        return ref[pl.ds(start, rows)]
    return pltriton.load(ref.at[pl.ds(start, rows)], mask=start + jnp.arange(rows) < seq_len, other=0.0)


# ------------------------------------------------------------------------------------------------------ scores


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` of 2-D tiles into float32; float32 tiles multiply in full precision (not TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def scores(a: jax.Array, b: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *, scale: float, masked: bool,
           causal: bool, k_len: int, same_doc: jax.Array | None = None) -> jax.Array:
    """``a b^T * scale * log2(e)`` in float32: ``S`` for ``(a, b) = (q, k)``, ``S^T`` for ``(k, q)``.

    ``q_pos``, ``k_pos``: query and key positions in the keys' sequence, shaped to broadcast against the result
    (``[n,1]``, ``[1,m]`` or transposed). Masked blocks get the causal mask and, for a ragged tail, the key-range mask
    (``< k_len``); ``same_doc`` (the result's shape, bool): also the document mask.
    """
    s = dot(a, b.T) * (scale * LOG2E)
    if not masked:
        return s
    keep = (q_pos >= k_pos) if causal else None
    if same_doc is not None:
        keep = same_doc if keep is None else keep & same_doc
    if k_len % k_pos.size:
        keep = k_pos < k_len if keep is None else keep & (k_pos < k_len)
    return s if keep is None else jnp.where(keep, s, MASKED)


def positions(start, n: int, axis: int) -> jax.Array:
    """``start + [0, n)`` as a column (``axis=0``, ``[n,1]``) or a row (``axis=1``, ``[1,n]``)."""
    pos = start + jnp.arange(n)
    return pos[:, None] if axis == 0 else pos[None, :]


# ------------------------------------------------------------------------------------------------ block ranges


def shift(row, offset: jax.Array | None):
    """A query row's position in the keys' sequence."""
    return row if offset is None else row + offset


def _row_at(position, offset: jax.Array | None):
    """The first query row at or after a key ``position`` (0 when every row is)."""
    return position if offset is None else jnp.maximum(position - offset, 0)


def key_blocks(qi, offset: jax.Array | None, bq: int, bk: int, k_len: int, causal: bool):
    """Key blocks a query block ``qi`` sees: ``[0, n_full)`` need no mask, ``[n_full, n_all)`` do."""
    n_keys = pl.cdiv(k_len, bk)
    if not causal:
        return k_len // bk, n_keys
    # Keys below the block's first row are visible to all its rows (and < k_len, as that row is).
    return lax.div(shift(qi * bq, offset), bk), jnp.minimum(lax.div(shift((qi + 1) * bq, offset) + bk - 1, bk),
                                                            n_keys)


def query_blocks(kj, offset: jax.Array | None, bq: int, bk: int, q_len: int, causal: bool):
    """Query blocks a key block ``kj`` reaches: ``[first, n_masked)`` need the mask, ``[n_masked, n_all)`` not
    (``first`` may pass ``n_masked`` for keys after every query: both ranges are then empty)."""
    n_q = pl.cdiv(q_len, bq)
    if not causal:
        return 0, 0, n_q
    return lax.div(_row_at(kj * bk, offset), bq), jnp.minimum(lax.div(_row_at((kj + 1) * bk, offset) + bq - 1, bq),
                                                              n_q), n_q


def document_blocks(start_ref, end_ref, first, rows: int, block: int, n_blocks, causal_last,
                    offset: jax.Array | None = None):
    """The blocks (of ``block`` rows of the other side) that rows ``[first, first + rows)`` can see: from the one
    holding their first document's start to the one holding their last document's end (or ``causal_last``), and the
    rows' document starts ``[rows]``. ``offset``: the other side is the queries, whose row 0 sits at that position."""
    start = start_ref[pl.ds(first, rows)]
    lo = lax.div(_row_at(jnp.min(start), offset), block)
    if causal_last is not None:
        return lo, causal_last, start
    last = jnp.max(end_ref[pl.ds(first, rows)])
    last = last if offset is None else last - offset
    through = lax.div(jnp.maximum(last + block, 0), block)  # up to the block holding row `last`; none before row 0
    return lo, jnp.minimum(through, n_blocks), start


def query_key_blocks(static: Static, docs, qi, offset: jax.Array | None, bq: int, bk: int, k_len: int):
    """``(n_full, n_all, q_start)`` of query block ``qi`` (forward and dQ kernels): key blocks ``[0, n_full)`` unmasked,
    ``[n_full, n_all)`` masked (with documents every visited block is masked: ``n_full`` is their first), and the
    rows' document starts ``[bq]`` (None without documents)."""
    n_full, n_all = key_blocks(qi, offset, bq, bk, k_len, static.causal)
    if not docs:
        return n_full, n_all, None
    return document_blocks(docs.q_start, docs.q_end, qi * bq, bq, bk, pl.cdiv(k_len, bk),
                           n_all if static.causal else None)


def same_document(q_start: jax.Array | None, docs, kj, bk: int) -> jax.Array | None:
    """``[bq, bk]`` bool: each query row's document is each key's of key block ``kj`` (None without documents)."""
    return None if q_start is None else q_start[:, None] == docs.k_start[pl.ds(kj * bk, bk)][None, :]


def has_offset(q_offset: int | jax.Array | None, q_len: int, k_len: int) -> bool:
    """Whether queries sit at an offset in the keys' sequence other than self-attention's 0 (``None``: ``k_len -
    q_len``; a traced offset counts as one)."""
    return q_len != k_len or not (q_offset is None or isinstance(q_offset, int) and q_offset == 0)


def row_block(causal: bool):
    """This program's row block; causal grids run the longest (last) blocks first."""
    i = pl.program_id(0)
    return pl.num_programs(0) - 1 - i if causal else i


# ----------------------------------------------------------------------------------------------- pallas call


def launch(kernel, kc: tuning.AttentionKernel, static: Static, grid_rows: int, inputs, out_shape, name: str, *,
           q_len: int, k_len: int, **kernel_kw):
    """One ``pallas_call`` with grid ``(grid_rows, B, H)``: every operand is one (batch, head) slab.

    Sequence operands ``[B,T,H,D]`` (``T``: ``q_len`` or ``k_len``) get a ``[Tp, Dpad]`` block, document bounds
    ``[B,Tp]`` a ``[Tp]`` block, row statistics ``[B,H,Tp]`` a ``[Tp]`` block, the offset ``[]`` itself.
    """
    B, _, H = inputs[0].shape[:3]

    def spec(shape):
        if len(shape) == 0:  # the queries' offset
            return pl.BlockSpec((), lambda i, b, h: ())
        if len(shape) == 2:  # [B, Tp] document bounds
            return pl.BlockSpec((None, shape[1]), lambda i, b, h: (b, 0))
        if len(shape) == 3:  # [B, H, Tp] statistics
            return pl.BlockSpec((None, None, shape[2]), lambda i, b, h: (b, h, 0))
        rows = padded_len(static, shape[1], q_len, k_len)
        return pl.BlockSpec((None, rows, None, pow2(shape[-1])), lambda i, b, h: (b, 0, h, 0))

    return pl.pallas_call(
        functools.partial(kernel, static=static, q_len=q_len, k_len=k_len, **kernel_kw),
        grid=(grid_rows, B, H),
        in_specs=[spec(x.shape) for x in inputs],
        out_specs=[spec(s.shape) for s in out_shape],
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=kc.launch.num_warps, num_stages=kc.launch.num_stages),
        interpret=static.interpret,
        name=name,
    )(*inputs)
