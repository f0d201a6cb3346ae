"""In-kernel math shared by the recurrent kernels: masks, decayed Gram products, the triangular inverse.

Everything here runs inside a Pallas kernel (Triton lowering) on tiles already loaded from refs, except the
``blocks`` / ``store_*`` helpers, which load and store row blocks of a chunk's ref. Only 2-D dots, power-of-two
tiles, and masks applied to exponents before ``exp`` (the Triton lowering's limits).

Row blocks. With a per-key gate (KDA) a chunk of ``C`` rows is split into blocks of ``SUB = 16`` rows: a pair of
rows in two different blocks (``j``'s block before ``i``'s) is decayed around ``r`` = gamma at the first row of
``i``'s block, in one matmul per block pair (:func:`cross_factors`), and only the diagonal blocks use the
``log2(SUB)`` levels of :func:`level_factors`. Lists of blocks, and lower block-triangular lists of lists
``m[i][j], j <= i``, are what these helpers pass around; with a scalar gate the whole chunk is one block.

``gamma`` is the chunk-local cumulative log decay: ``[C]`` (scalar gate) or ``[C, K]`` (per key channel); it is
non-increasing along rows, so every decay factor formed here is at most 1 (tiny ones underflow harmlessly).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

F32 = jnp.float32
SUB = 16  # rows per diagonal block with a per-key gate


def dot(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """2-D matmul with a float32 accumulator."""
    return jnp.dot(a, b, preferred_element_type=F32, precision=precision)


def iota(n: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of an ``[n, n]`` tile."""
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)


def tri(C: int, strict: bool) -> jax.Array:
    """``[C, C]``: the lower triangle, strict (``j < i``) or with the diagonal (``j <= i``)."""
    i, j = iota(C)
    return (i > j) if strict else (i >= j)


def masked_exp(diff: jax.Array, mask: jax.Array) -> jax.Array:
    """``exp(diff)`` where ``mask`` else 0; the exponent is masked first so nothing overflows."""
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def row(x: jax.Array, index: int) -> jax.Array:
    """Row ``index`` of a gate tile ``[C]`` (a scalar) or ``[C, K]`` (``[K]``); a masked sum, since Triton has no
    dynamic element extraction. ``row(gamma, -1)`` is ``gamma_last``."""
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(idx == index % x.shape[0], x, 0.0), axis=0)


def per_column(x: jax.Array) -> jax.Array:
    """A per-token gate factor ``[C]`` or ``[C, K]`` shaped to scale the K columns of a ``[C, K]`` tile."""
    return x if x.ndim == 2 else x[:, None]


def to_gate_shape(x: jax.Array, per_key: bool) -> jax.Array:
    """A ``[C, K]`` gradient contribution reduced to the gate's shape (``[C]`` for a scalar gate)."""
    return x if per_key else jnp.sum(x, axis=1)


def state_decay(gamma_last: jax.Array) -> jax.Array:
    """``exp(gamma_last)`` shaped to scale the rows of a ``[K, BV]`` state."""
    return jnp.exp(gamma_last)[:, None] if gamma_last.ndim == 1 else jnp.exp(gamma_last)


def level_mask(C: int, level: int) -> jax.Array:
    """``[C, C]``: pairs ``j < i`` that first fall in different halves of a ``2^(level+1)``-row block: ``i`` in the
    second half, ``j`` in the first. Over ``level = 0 .. log2(C) - 1`` these partition the strict lower triangle."""
    i, j = iota(C)
    return ((i >> (level + 1)) == (j >> (level + 1))) & ((i >> level) != (j >> level)) & (i > j)


def level_factors(gamma: jax.Array, level: int) -> tuple[jax.Array, jax.Array]:
    """``[C, K]`` decay factors of one level around ``r`` = gamma at the first row of the second half of each row's
    ``2^(level+1)``-block: ``exp(gamma_i - r)`` on second-half rows and ``exp(r - gamma_j)`` on first-half rows (0
    elsewhere). Both are <= 1 and their product is ``exp(gamma_i - gamma_j)`` for the pairs of :func:`level_mask`;
    ``r`` is at or before row ``i``, so no later gate is read. ``r`` is broadcast over each block by a reshape to
    ``[blocks, 2^(level+1), K]`` and a masked sum (exact)."""
    C, K = gamma.shape
    P = 2 << level
    blocks = gamma.reshape(C // P, P, K)
    pos = lax.broadcasted_iota(jnp.int32, blocks.shape, 1)
    r = jnp.sum(jnp.where(pos == P // 2, blocks, 0.0), axis=1)
    r = jnp.broadcast_to(r[:, None, :], blocks.shape).reshape(C, K)
    rows = lax.broadcasted_iota(jnp.int32, gamma.shape, 0)
    second = (rows >> level) != ((rows >> (level + 1)) << 1)
    return masked_exp(gamma - r, second), masked_exp(r - gamma, jnp.logical_not(second))


def gram(a: jax.Array, b: jax.Array, gamma: jax.Array, strict: bool) -> jax.Array:
    """``G_ij = sum_d a_id b_jd exp(gamma_i(d) - gamma_j(d))`` for ``j < i`` (``j <= i`` unless strict), else 0.

    ``a, b: [C, K]``; ``gamma: [C]`` (the decay leaves the matmul) or ``[C, K]``: one factored matmul per level of
    :func:`level_factors`, operands rounded to the input dtype (the diagonal needs no decay)."""
    C = a.shape[0]
    i, j = iota(C)
    if gamma.ndim == 1:
        return dot(a, b.T) * masked_exp(gamma[:, None] - gamma[None, :], tri(C, strict))
    cd = a.dtype
    af, bf = a.astype(F32), b.astype(F32)
    g = jnp.zeros((C, C), F32)
    for level in range(C.bit_length() - 1):
        row_f, col_f = level_factors(gamma, level)
        g = g + jnp.where(level_mask(C, level), dot((af * row_f).astype(cd), (bf * col_f).astype(cd).T), 0.0)
    if not strict:
        g = g + jnp.where(i == j, jnp.sum(af * bf, axis=1)[:, None], 0.0)
    return g


def wide_exponent(dtype) -> bool:
    """Whether ``dtype`` has float32's exponent range (bf16, float32): one-reference factors up to ``exp(span)`` fit."""
    return jnp.finfo(dtype).maxexp >= jnp.finfo(F32).maxexp


def decay_matmul(m: jax.Array, b: jax.Array, gamma: jax.Array, strict: bool, transpose: bool) -> jax.Array:
    """Per-key decayed product with a lower-triangular ``m [C, C]`` (entries outside the triangle are ignored):
    ``Y_id = sum_{j<=i} m_ij b_jd exp(gamma_id - gamma_jd)``, or transposed
    ``Y_jd = sum_{i>=j} m_ij b_id exp(gamma_id - gamma_jd)`` (strict: ``<``, ``>``). ``b, gamma: [C, K]``."""
    C = m.shape[0]
    cd = b.dtype
    bf = b.astype(F32)
    y = jnp.zeros(b.shape, F32)
    for level in range(C.bit_length() - 1):
        row_f, col_f = level_factors(gamma, level)
        ml = jnp.where(level_mask(C, level), m, 0.0)
        if transpose:
            y = y + col_f * dot(ml.T.astype(cd), (bf * row_f).astype(cd))
        else:
            y = y + row_f * dot(ml.astype(cd), (bf * col_f).astype(cd))
    if not strict:
        i, j = iota(C)
        y = y + jnp.sum(jnp.where(i == j, m, 0.0), axis=1)[:, None] * bf
    return y


def _rows_per_block(ref, per_key: bool) -> int:
    return SUB if per_key else ref.shape[0]


def blocks(ref, per_key: bool) -> list[jax.Array]:
    """The row blocks of a chunk tile ``ref [C, ...]``."""
    S = _rows_per_block(ref, per_key)
    rest = (slice(None),) * (len(ref.shape) - 1)
    return [ref[(pl.ds(i * S, S),) + rest] for i in range(ref.shape[0] // S)]


def store_blocks(ref, xs: list[jax.Array]) -> None:
    """Store row blocks ``xs`` into the chunk tile ``ref [C, ...]`` (cast to its dtype)."""
    S = xs[0].shape[0]
    rest = (slice(None),) * (len(ref.shape) - 1)
    for i, x in enumerate(xs):
        ref[(pl.ds(i * S, S),) + rest] = x.astype(ref.dtype)


def load_lower(ref, per_key: bool) -> list[list[jax.Array]]:
    """The lower blocks ``m[i][j]`` (``j <= i``) of a ``[C, C]`` tile."""
    S = _rows_per_block(ref, per_key)
    n = ref.shape[0] // S
    return [[ref[pl.ds(i * S, S), pl.ds(j * S, S)] for j in range(i + 1)] for i in range(n)]


def store_lower(ref, m: list[list[jax.Array]]) -> None:
    """A lower block-triangular ``[C, C]`` tile (zeros above the diagonal blocks)."""
    S = m[0][0].shape[0]
    for i in range(len(m)):
        for j in range(len(m)):
            x = m[i][j] if j <= i else jnp.zeros((S, S), ref.dtype)
            ref[pl.ds(i * S, S), pl.ds(j * S, S)] = x.astype(ref.dtype)


def cross_factors(gamma_i: jax.Array, gamma_j: jax.Array, cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """``(exp(gamma_i - r), exp(r - gamma_j))`` for the rows of block ``i`` and of an earlier block ``j``, around
    ``r`` = gamma at block ``i``'s first row: both <= 1, and their product is ``exp(gamma_i - gamma_j)``; no gate
    after row ``i`` is read. With ``j = i`` (a diagonal block around one reference row) the second factor is up to
    ``exp`` of the block's fall, capped at ``exp(cap)``: exact on the rows that fall by less than ``cap`` from
    ``r``, finite (and wrong) on the others."""
    r = row(gamma_i, 0)[None, :]
    row_f = jnp.exp(gamma_i - r)  # before the column factor: the Triton IR's order of the tuned kernels
    fall = r - gamma_j
    return row_f, jnp.exp(fall if cap is None else jnp.minimum(fall, cap))


def one_matmul_pairs(n: int, span: float):
    """The pairs ``(i, j, cap)`` of ``n`` row blocks whose decayed products take one matmul, with the factors of
    :func:`cross_factors` (``cap`` its argument): every ``j < i`` and, with ``span > 0`` (per-key gate), the
    diagonal blocks ``j = i`` too, around their first row, exact only on the rows whose gate has fallen by less than
    ``span`` from that row in every key channel (a second launch redoes the others with ``span = 0``: the levels;
    ``launch.diagonal_launches``). The caller keeps a diagonal block's lower triangle."""
    for i in range(n):
        for j in range(i + 1 if span > 0 else i):
            yield i, j, span if i == j else None


def block_gram(a: list, b: list, gamma: list, strict: bool, span: float) -> list[list[jax.Array]]:
    """:func:`gram` over row blocks: ``G[i][j]`` (float32) for ``j <= i``; the pairs of :func:`one_matmul_pairs`
    in one matmul each, the other diagonal blocks by the levels."""
    cd = a[0].dtype
    g = [[] for _ in a]
    for i, j, cap in one_matmul_pairs(len(a), span):
        row_f, col_f = cross_factors(gamma[i], gamma[j], cap)
        x = dot((a[i].astype(F32) * row_f).astype(cd), (b[j].astype(F32) * col_f).astype(cd).T)
        g[i].append(jnp.where(tri(x.shape[0], strict), x, 0.0) if i == j else x)
    if span <= 0:
        for i, row_blocks in enumerate(g):
            row_blocks.append(gram(a[i], b[i], gamma[i], strict))
    return g


def block_decay_matmul(m: list, b: list, gamma: list, strict: bool, transpose: bool, span: float) -> list[jax.Array]:
    """:func:`decay_matmul` over row blocks (per-key gate): ``m`` lower block-triangular, ``b``/``gamma`` blocks; the
    pairs of :func:`one_matmul_pairs` in one matmul each, the other diagonal blocks by the levels."""
    cd = b[0].dtype
    y = [None if span > 0 else decay_matmul(m[i][i], b[i], gamma[i], strict, transpose) for i in range(len(b))]
    for i, j, cap in one_matmul_pairs(len(b), span):
        mij = jnp.where(tri(m[i][i].shape[0], strict), m[i][i], 0.0) if i == j else m[i][j]
        row_f, col_f = cross_factors(gamma[i], gamma[j], cap)
        if transpose:
            t, term = j, col_f * dot(mij.T.astype(cd), (b[i].astype(F32) * row_f).astype(cd))
        else:
            t, term = i, row_f * dot(mij.astype(cd), (b[j].astype(F32) * col_f).astype(cd))
        y[t] = term if y[t] is None else y[t] + term
    return y


def dot_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """A float32 matmul as three bf16 tensor-core matmuls, ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` (about 16 mantissa
    bits): Triton runs IEEE float32 dots on CUDA cores, many times slower."""
    a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    a_lo = (a - a_hi.astype(F32)).astype(jnp.bfloat16)
    b_lo = (b - b_hi.astype(F32)).astype(jnp.bfloat16)
    return dot(a_hi, b_hi) + dot(a_hi, b_lo) + dot(a_lo, b_hi)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)^-1`` for a strictly lower-triangular float32 ``[C, C]`` tile (C a power of two).

    Block doubling: with ``X`` the inverse of the diagonal ``b x b`` blocks and ``L`` the lower-left ``b x b``
    blocks of each ``2b x 2b`` diagonal block, the inverse of the ``2b`` blocks is ``X - X L X``. Every
    intermediate is a block of the true inverse (no powers of ``a`` that could overflow), and it needs only
    ``2 log2(C) - 2`` matmuls (:func:`dot_f32`)."""
    C = a.shape[0]
    i, j = iota(C)
    x = jnp.where(i == j, 1.0, 0.0) - jnp.where((i >> 1) == (j >> 1), a, 0.0)
    level = 1
    while (1 << level) < C:
        off = ((i >> (level + 1)) == (j >> (level + 1))) & ((i >> level) != (j >> level))
        x = x - dot_f32(dot_f32(x, jnp.where(off, a, 0.0)), x)
        level += 1
    return x


def block_unit_lower_inverse(a: list) -> list[list[jax.Array]]:
    """``(I + A)^-1`` of a strictly lower block-triangular ``A`` (``a[i][j]``, float32): the diagonal blocks by
    :func:`unit_lower_inverse`, then block forward substitution ``T_ij = -T_ii sum_{j<=l<i} A_il T_lj``."""
    t = []
    for i in range(len(a)):
        t_ii = unit_lower_inverse(a[i][i])
        row_blocks = []
        for j in range(i):
            acc = dot_f32(a[i][j], t[j][j])
            for m in range(j + 1, i):
                acc = acc + dot_f32(a[i][m], t[m][j])
            row_blocks.append(-dot_f32(t_ii, acc))
        t.append(row_blocks + [t_ii])
    return t


def total(xs: list[jax.Array]) -> jax.Array:
    """The sum of a list of tiles."""
    return functools.reduce(operator.add, xs)


def lower_matmul(m: list, x: list) -> list[jax.Array]:
    """``(M X)_i = sum_{j<=i} m[i][j] x[j]`` for a lower block-triangular ``M`` (float32 accumulation)."""
    return [total([dot(m[i][j], x[j]) for j in range(i + 1)]) for i in range(len(m))]


def lower_matmul_t(m: list, x: list) -> list[jax.Array]:
    """``(M^T X)_j = sum_{i>=j} m[i][j]^T x[i]`` for a lower block-triangular ``M`` (float32 accumulation)."""
    return [total([dot(m[i][j].T, x[i]) for i in range(j, len(m))]) for j in range(len(m))]


def inclusive_sums(x: jax.Array, reverse: bool) -> jax.Array:
    """``[S, D]`` -> float32 inclusive sums over rows (``reverse``: of each row and the later ones), by an ``[S, S]``
    triangular matmul in IEEE float32 (the operands are not rounded)."""
    i, j = iota(x.shape[0])
    return dot(((i <= j) if reverse else (i >= j)).astype(F32), x.astype(F32), lax.Precision.HIGHEST)


def far_blocks(gamma: list[jax.Array], span: float, causal: bool) -> list[jax.Array]:
    """``[SUB]`` bool per row block of a chunk's per-key gate: the rows that one-reference diagonal blocks get wrong.
    A row is far once some key channel's gate has moved by ``span`` or more from its block's first row. ``causal``
    (forward): that row and every later row of the chunk (``T`` carries a wrong row into the later ones), so no
    row's choice reads a later gate; else (gradient pass, whose diagonal products mix a block's rows): every row of
    that block."""
    far, carry = [], None
    for g in gamma:
        moved = (jnp.max(jnp.abs(g - row(g, 0)[None, :]), axis=1) >= span).astype(F32)
        if causal:  # any row j <= i, and any row of an earlier block
            f = jnp.max(jnp.where(tri(g.shape[0], strict=False), moved[None, :], 0.0), axis=1)
            f = f if carry is None else jnp.maximum(f, carry)
            carry = row(f, -1)
        else:
            f = jnp.zeros_like(moved) + jnp.max(moved)
        far.append(f > 0)
    return far
