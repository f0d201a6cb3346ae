"""Chunked gated delta rule (GDN), Kimi Delta Attention (KDA) and scalar-gated linear attention (GLA / Mamba2 SSD)
in Pallas.

One kernel family, Triton lowering (NVIDIA and ROCm), forward and backward under ``jax.custom_vjp``.
The algorithm is the WY/UT chunk form of :func:`hybrid_jax.kernels.reference.chunked_recurrence`; per
chunk of ``C`` tokens with chunk-local cumulative log decay ``gamma`` and start state ``h``::

    A     = strict_lower(beta_i k_i.k_j exp(gamma_i - gamma_j)),   T = (I + A)^-1      (delta rule only)
    u     = T (beta V),   w = T (beta exp(gamma) K),   v_new = u - w h                   (GLA: v_new = V)
    o     = (scale Q exp(gamma)) h + incl_lower(scale Q K^T exp(gamma_i - gamma_j)) v_new
    h'    = exp(gamma_last) h + (K exp(gamma_last - gamma))^T v_new

Kernels (``grid`` in brackets; ``N`` chunks, ``NV`` value tiles):

forward   ``wy``        [B, HV, N]   A, T by a block-doubling inverse in float32, u, w   (delta rule only)
          ``state``     [B, HV, NV]  sequential over chunks, float32 state in registers: h snapshots, v_new
          ``output``    [B, HV, N]   o  (``RecurrentConfig.output_in_state``: in ``state`` instead, ``P`` from ``wy``)
backward  ``state_bwd`` [B, HV, NV]  reverse sequential pass: dh snapshots, d(v_new), d(initial state)
          ``grad``      [B, HV, N]   dq, dk, dv, dbeta, d(gamma) (WY backward included; at large K V optionally
                                     split in two launches, ``grad`` and ``grad_wy``: ``split_grad_from``; with
                                     ``block_k`` also over K tiles)

The chunk-parallel launches (``[B, HV, N]``) may instead have ``N / P`` programs that each loop over ``P`` consecutive
chunks (``RecurrentConfig.chunks_per_program``), so that Triton's pipeline prefetches one chunk's tiles while it
computes the previous one.

The WY backward needs neither u nor w: with ``v_new = u - w h``, ``dA = -(T^T dv_new) v_new^T`` and
``T^T dw = -(T^T dv_new) h^T``, so the backward keeps ``w`` (for the reverse state pass), not ``u``.

XLA glue does the cheap elementwise work: padding (T to a multiple of C, K and V to powers of two),
the optional L2 norm of q and k, the chunk-local gate cumsum (its VJP is the reverse cumsum), and the
sum of q/k gradients over grouped value heads.

Per-key gate (KDA, ``g [B,T,HV,K]``): ``gamma`` is a ``[C, K]`` tile and ``exp(gamma_i - gamma_j)`` sits inside
the K-contraction of ``A`` and ``P`` (and of their gradients). The chunk is split into blocks of ``SUB = 16`` rows.
A pair in two different blocks is decayed around ``r`` = ``gamma`` at the first row of the later block (both factors
``exp(gamma_i - r)`` and ``exp(r - gamma_j)`` are <= 1), one ``[16, K] x [K, 16]`` matmul per block pair
(:func:`_cross_factors`). Inside a diagonal block the factorisation is hierarchical (:func:`_level_factors`): each
pair ``j < i`` belongs to the one level at which ``i`` and ``j`` fall in different halves of a ``2^(l+1)``-row block,
and there the reference is ``gamma`` at the first row of ``i``'s half. No factor exceeds 1 at any gate (tiny values
underflow harmlessly), no gate after row ``i`` is read, and there is no token loop. Each such kernel first runs
with one matmul around the block's first row in place of the levels (factors up to ``exp(cfg.one_reference_span)``),
exact where the gate moves by less than the span within the block; a second launch with the levels then rewrites,
in place, only the rows that moved further, in the chunks XLA flagged, its programs (several chunks each) exiting
after loading the flags (:func:`_diagonal_launches`; in the forward a row's choice reads no later gate, so no output
depends on one).
FLA computes its diagonal blocks token by token (or with a midpoint anchor that can read a later gate). The kernels
work on lists of row blocks (loaded and stored by ``pl.ds`` slices of the chunk's tiles: Triton has no
concatenation); ``T`` becomes block lower-triangular by forward substitution over the blocks
(:func:`_block_unit_lower_inverse`). The output kernel also stores ``P`` (input dtype, like ``T``) for the reverse
state pass. With a scalar gate a chunk is one block.

Inputs may be bf16 or float32; matmul operands are cast to the input dtype and accumulate in float32.
The carried state, the gate sums, the gradients and the triangular inverse are computed in float32; the
intermediates kept in HBM (u, w, T, v_new, per-chunk state snapshots) are stored in the input dtype, as
FLA does. Only 2-D dots, power-of-two blocks, ``fori_loop`` loops and masks applied to exponents before
``exp`` (the Triton lowering's limits).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import reference
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig, fit_stages, recurrent_config

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Static:
    """Non-differentiable, hashable arguments of the custom VJP."""

    scale: float
    chunk: int
    cfg: RecurrentConfig
    interpret: bool


# ----------------------------------------------------------------------------------------------- in-kernel helpers


def _dot(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """2-D matmul with a float32 accumulator."""
    return jnp.dot(a, b, preferred_element_type=F32, precision=precision)


def _iota(n: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of an ``[n, n]`` tile."""
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)


def _tri(C: int, strict: bool) -> jax.Array:
    """``[C, C]``: the lower triangle, strict (``j < i``) or with the diagonal (``j <= i``)."""
    i, j = _iota(C)
    return (i > j) if strict else (i >= j)


def _masked_exp(diff: jax.Array, mask: jax.Array) -> jax.Array:
    """``exp(diff)`` where ``mask`` else 0; the exponent is masked first so nothing overflows."""
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def _row(x: jax.Array, index: int) -> jax.Array:
    """Row ``index`` of a gate tile: a scalar (``[C]`` gate) or ``[K]`` (``[C, K]`` gate); a masked sum, since Triton
    has no dynamic element extraction. ``_row(gam, -1)`` is ``gamma_last``."""
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(idx == index % x.shape[0], x, 0.0), axis=0)


def _col(x: jax.Array) -> jax.Array:
    """A per-token gate factor broadcast over the K columns of a ``[C, K]`` tile."""
    return x if x.ndim == 2 else x[:, None]


def _red(x: jax.Array, per_key: bool) -> jax.Array:
    """A ``[C, K]`` gradient contribution reduced to the gate's shape (``[C]`` for a scalar gate)."""
    return x if per_key else jnp.sum(x, axis=1)


def _state_decay(gl: jax.Array) -> jax.Array:
    """``exp(gamma_last)`` shaped to scale the rows of a ``[K, BV]`` state."""
    return jnp.exp(gl)[:, None] if gl.ndim == 1 else jnp.exp(gl)


def _level_mask(C: int, level: int) -> jax.Array:
    """``[C, C]``: pairs ``j < i`` that first fall in different halves of a ``2^(level+1)``-row block: ``i`` in the
    second half, ``j`` in the first. Over ``level = 0 .. log2(C) - 1`` these partition the strict lower triangle."""
    i, j = _iota(C)
    return ((i >> (level + 1)) == (j >> (level + 1))) & ((i >> level) != (j >> level)) & (i > j)


def _level_factors(gam: jax.Array, level: int) -> tuple[jax.Array, jax.Array]:
    """``[C, K]`` decay factors of one level around ``r`` = ``gamma`` at the first row of the second half of each
    row's ``2^(level+1)``-block: ``exp(gamma_i - r)`` on second-half rows and ``exp(r - gamma_j)`` on first-half
    rows (0 elsewhere). Both are <= 1 (``gamma`` is non-increasing) and their product is ``exp(gamma_i -
    gamma_j)`` for the pairs of :func:`_level_mask`; ``r`` is at or before row ``i``, so no later gate is read.
    ``r`` is broadcast over each block by a reshape to ``[blocks, 2^(level+1), K]`` and a masked sum (exact)."""
    C, K = gam.shape
    P = 2 << level
    blocks = gam.reshape(C // P, P, K)
    pos = lax.broadcasted_iota(jnp.int32, blocks.shape, 1)
    r = jnp.sum(jnp.where(pos == P // 2, blocks, 0.0), axis=1)
    r = jnp.broadcast_to(r[:, None, :], blocks.shape).reshape(C, K)
    rows = lax.broadcasted_iota(jnp.int32, gam.shape, 0)
    second = (rows >> level) != ((rows >> (level + 1)) << 1)
    return _masked_exp(gam - r, second), _masked_exp(r - gam, jnp.logical_not(second))


def _gram(a: jax.Array, b: jax.Array, gam: jax.Array, strict: bool, f32_operands: bool = False) -> jax.Array:
    """``G_ij = sum_d a_id b_jd exp(gamma_i(d) - gamma_j(d))`` for ``j < i`` (``j <= i`` unless strict), else 0.

    ``a, b: [C, K]``; ``gam: [C]`` (the decay leaves the matmul) or ``[C, K]``: one factored matmul per level of
    :func:`_level_factors` (the diagonal needs no decay). ``f32_operands``: the factored operands stay float32 (TF32
    tensor cores on NVIDIA) instead of being rounded to the input dtype."""
    C = a.shape[0]
    i, j = _iota(C)
    if gam.ndim == 1:
        return _dot(a, b.T) * _masked_exp(gam[:, None] - gam[None, :], _tri(C, strict))
    cd = F32 if f32_operands else a.dtype
    af, bf = a.astype(F32), b.astype(F32)
    g = jnp.zeros((C, C), F32)
    for level in range(C.bit_length() - 1):
        row_f, col_f = _level_factors(gam, level)
        g = g + jnp.where(_level_mask(C, level), _dot((af * row_f).astype(cd), (bf * col_f).astype(cd).T), 0.0)
    if not strict:
        g = g + jnp.where(i == j, jnp.sum(af * bf, axis=1)[:, None], 0.0)
    return g


def _wide_exponent(dtype) -> bool:
    """Whether ``dtype`` has float32's exponent range (bf16, float32): one-reference factors up to ``exp(span)`` fit."""
    return jnp.finfo(dtype).maxexp >= jnp.finfo(F32).maxexp


def _decay_matmul(m: jax.Array, b: jax.Array, gam: jax.Array, strict: bool, transpose: bool) -> jax.Array:
    """Per-key decayed product with a lower-triangular ``m [C, C]`` (entries outside the triangle are ignored):
    ``Y_id = sum_{j<=i} m_ij b_jd exp(gamma_id - gamma_jd)``, or transposed
    ``Y_jd = sum_{i>=j} m_ij b_id exp(gamma_id - gamma_jd)`` (strict: ``<``, ``>``). ``b, gam: [C, K]``."""
    C = m.shape[0]
    cd = b.dtype
    bf = b.astype(F32)
    y = jnp.zeros(b.shape, F32)
    for level in range(C.bit_length() - 1):
        row_f, col_f = _level_factors(gam, level)
        ml = jnp.where(_level_mask(C, level), m, 0.0)
        if transpose:
            y = y + col_f * _dot(ml.T.astype(cd), (bf * row_f).astype(cd))
        else:
            y = y + row_f * _dot(ml.astype(cd), (bf * col_f).astype(cd))
    if not strict:
        i, j = _iota(C)
        y = y + jnp.sum(jnp.where(i == j, m, 0.0), axis=1)[:, None] * bf
    return y


# Row blocks. With a per-key gate a chunk is split into blocks of SUB rows: a pair of rows in two different blocks
# (j's block before i's) is decayed around r = gamma at the first row of i's block, in ONE matmul per block pair
# (:func:`_cross_factors`), and only the diagonal blocks use the log2(SUB) levels. Lists of blocks (and lower
# block-triangular lists of lists ``m[i][j], j <= i``) are what the helpers below pass around; with a scalar gate
# the whole chunk is one block.

SUB = 16


def _rows_per_block(ref, per_key: bool) -> int:
    return SUB if per_key else ref.shape[0]


def _blocks(ref, per_key: bool) -> list[jax.Array]:
    """The row blocks of a chunk tile ``ref [C, ...]``."""
    S = _rows_per_block(ref, per_key)
    rest = (slice(None),) * (len(ref.shape) - 1)
    return [ref[(pl.ds(i * S, S),) + rest] for i in range(ref.shape[0] // S)]


def _store_blocks(ref, blocks: list[jax.Array]) -> None:
    S = blocks[0].shape[0]
    rest = (slice(None),) * (len(ref.shape) - 1)
    for i, x in enumerate(blocks):
        ref[(pl.ds(i * S, S),) + rest] = x.astype(ref.dtype)


def _load_lower(ref, per_key: bool) -> list[list[jax.Array]]:
    """The lower blocks ``m[i][j]`` (``j <= i``) of a ``[C, C]`` tile."""
    S = _rows_per_block(ref, per_key)
    n = ref.shape[0] // S
    return [[ref[pl.ds(i * S, S), pl.ds(j * S, S)] for j in range(i + 1)] for i in range(n)]


def _store_lower(ref, m: list[list[jax.Array]]) -> None:
    """A lower block-triangular ``[C, C]`` tile (zeros above the diagonal blocks)."""
    S = m[0][0].shape[0]
    for i in range(len(m)):
        for j in range(len(m)):
            x = m[i][j] if j <= i else jnp.zeros((S, S), ref.dtype)
            ref[pl.ds(i * S, S), pl.ds(j * S, S)] = x.astype(ref.dtype)


def _cross_factors(gam_i: jax.Array, gam_j: jax.Array, cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """``(exp(gamma_i - r), exp(r - gamma_j))`` for the rows of block ``i`` and of an earlier block ``j``, around
    ``r`` = gamma at block ``i``'s first row: both <= 1 (``gamma`` is non-increasing), and their product is
    ``exp(gamma_i - gamma_j)``; no gate after row ``i`` is read. With ``j = i`` (a diagonal block around one
    reference row) the second factor is up to ``exp`` of the block's fall, capped at ``exp(cap)``: exact on the
    rows that fall by less than ``cap`` from ``r``, finite (and wrong) on the others."""
    r = _row(gam_i, 0)[None, :]
    row_f = jnp.exp(gam_i - r)  # before the column factor: the order of the timed builds' Triton IR
    fall = r - gam_j
    return row_f, jnp.exp(fall if cap is None else jnp.minimum(fall, cap))


def _one_matmul_pairs(n: int, span: float):
    """The pairs ``(i, j, cap)`` of ``n`` row blocks whose decayed products take one matmul, with the factors of
    :func:`_cross_factors` (``cap`` its argument): every ``j < i`` and, with ``span > 0`` (per-key gate), the
    diagonal blocks ``j = i`` too, around their first row, exact only on the rows whose gate has fallen by less than
    ``span`` from that row in every key channel (the caller redoes the others with ``span = 0``: the levels,
    :func:`_diagonal_launches`). The caller keeps a diagonal block's lower triangle."""
    for i in range(n):
        for j in range(i + 1 if span > 0 else i):
            yield i, j, span if i == j else None


def _block_gram(a: list, b: list, gam: list, strict: bool, f32_operands: bool, span: float) -> list[list[jax.Array]]:
    """:func:`_gram` over row blocks: ``G[i][j]`` (float32) for ``j <= i``; the pairs of :func:`_one_matmul_pairs`
    in one matmul each, the other diagonal blocks by the levels."""
    cd = F32 if f32_operands else a[0].dtype
    g = [[] for _ in a]
    for i, j, cap in _one_matmul_pairs(len(a), span):
        row_f, col_f = _cross_factors(gam[i], gam[j], cap)
        x = _dot((a[i].astype(F32) * row_f).astype(cd), (b[j].astype(F32) * col_f).astype(cd).T)
        g[i].append(jnp.where(_tri(x.shape[0], strict), x, 0.0) if i == j else x)
    if span <= 0:
        for i, row in enumerate(g):
            row.append(_gram(a[i], b[i], gam[i], strict, f32_operands))
    return g


def _block_decay_matmul(m: list, b: list, gam: list, strict: bool, transpose: bool, span: float) -> list[jax.Array]:
    """:func:`_decay_matmul` over row blocks (per-key gate): ``m`` lower block-triangular, ``b``/``gam`` blocks; the
    pairs of :func:`_one_matmul_pairs` in one matmul each, the other diagonal blocks by the levels."""
    cd = b[0].dtype
    y = [None if span > 0 else _decay_matmul(m[i][i], b[i], gam[i], strict, transpose) for i in range(len(b))]
    for i, j, cap in _one_matmul_pairs(len(b), span):
        mij = jnp.where(_tri(m[i][i].shape[0], strict), m[i][i], 0.0) if i == j else m[i][j]
        row_f, col_f = _cross_factors(gam[i], gam[j], cap)
        if transpose:
            t, term = j, col_f * _dot(mij.T.astype(cd), (b[i].astype(F32) * row_f).astype(cd))
        else:
            t, term = i, row_f * _dot(mij.astype(cd), (b[j].astype(F32) * col_f).astype(cd))
        y[t] = term if y[t] is None else y[t] + term
    return y


def _dot_f32(a: jax.Array, b: jax.Array, split: bool) -> jax.Array:
    """A float32 matmul: three bf16 tensor-core matmuls (``a_hi b_hi + a_hi b_lo + a_lo b_hi``, about 16 mantissa
    bits) when ``split``, else IEEE float32 dots, which Triton runs on CUDA cores (with those the GDN forward took
    10 ms on the H200 at B8 T2048 H16 K=V=128, against 0.4 ms for GLA)."""
    if not split:
        return _dot(a, b, lax.Precision.HIGHEST)
    a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    a_lo = (a - a_hi.astype(F32)).astype(jnp.bfloat16)
    b_lo = (b - b_hi.astype(F32)).astype(jnp.bfloat16)
    return _dot(a_hi, b_hi) + _dot(a_hi, b_lo) + _dot(a_lo, b_hi)


def _unit_lower_inverse(a: jax.Array, split: bool) -> jax.Array:
    """``(I + a)^-1`` for a strictly lower-triangular float32 ``[C, C]`` tile (C a power of two).

    Block doubling: with ``X`` the inverse of the diagonal ``b x b`` blocks and ``L`` the lower-left
    ``b x b`` blocks of each ``2b x 2b`` diagonal block, the inverse of the ``2b`` blocks is
    ``X - X L X``. Every intermediate is a block of the true inverse (no powers of ``a`` that could
    overflow), and it needs only ``2 log2(C) - 2`` matmuls (:func:`_dot_f32`).
    """
    C = a.shape[0]
    i, j = _iota(C)
    x = jnp.where(i == j, 1.0, 0.0) - jnp.where((i >> 1) == (j >> 1), a, 0.0)
    level = 1
    while (1 << level) < C:
        off = ((i >> (level + 1)) == (j >> (level + 1))) & ((i >> level) != (j >> level))
        x = x - _dot_f32(_dot_f32(x, jnp.where(off, a, 0.0), split), x, split)
        level += 1
    return x


def _block_unit_lower_inverse(a: list, split: bool) -> list[list[jax.Array]]:
    """``(I + A)^-1`` of a strictly lower block-triangular ``A`` (``a[i][j]``, float32): the diagonal blocks by
    :func:`_unit_lower_inverse`, then block forward substitution ``T_ij = -T_ii sum_{j<=l<i} A_il T_lj``."""
    t = []
    for i in range(len(a)):
        t_ii = _unit_lower_inverse(a[i][i], split)
        row = []
        for j in range(i):
            acc = _dot_f32(a[i][j], t[j][j], split)
            for m in range(j + 1, i):
                acc = acc + _dot_f32(a[i][m], t[m][j], split)
            row.append(-_dot_f32(t_ii, acc, split))
        t.append(row + [t_ii])
    return t


def _sum(xs: list[jax.Array]) -> jax.Array:
    return functools.reduce(operator.add, xs)


def _lower_matmul(m: list, x: list) -> list[jax.Array]:
    """``(M X)_i = sum_{j<=i} m[i][j] x[j]`` for a lower block-triangular ``M`` (float32 accumulation)."""
    return [_sum([_dot(m[i][j], x[j]) for j in range(i + 1)]) for i in range(len(m))]


def _lower_matmul_t(m: list, x: list) -> list[jax.Array]:
    """``(M^T X)_j = sum_{i>=j} m[i][j]^T x[i]`` for a lower block-triangular ``M`` (float32 accumulation)."""
    return [_sum([_dot(m[i][j].T, x[i]) for i in range(j, len(m))]) for j in range(len(m))]


# ----------------------------------------------------------------------------------------------------- kernels


def _wy_kernel(k_ref, v_ref, gam_ref, beta_ref, *refs, split: bool, f32_decay: bool, span: float,
               scale: float | None = None):
    """One chunk: ``T = (I + A)^-1``, ``u = T (beta V)``, ``w = T (beta exp(gamma) K)``; with ``scale`` (refs
    ``q_ref`` first, ``p_ref`` last: ``RecurrentConfig.output_in_state``) also the output's
    ``P = incl_lower(scale Q K^T decay)``, from the same gate factors as ``A``."""
    q_ref, u_ref, w_ref, t_ref, p_ref = refs if scale is not None else (None, *refs, None)
    per_key = len(gam_ref.shape) == 2
    # Inputs are loaded where they are first used and the operations keep the order of the single-tile kernels, so at
    # chunk 16 (one block) the Triton IR is op for op the one whose launches were tuned.
    k, gam, b = (_blocks(r, per_key) for r in (k_ref, gam_ref, beta_ref))
    cd = k[0].dtype
    b = [x.astype(F32) for x in b]
    g = _block_gram(k, k, gam, strict=True, f32_operands=f32_decay, span=span)
    a = [[x * b[i][:, None] for x in row] for i, row in enumerate(g)]
    # computed in float32, used (and stored) in the input dtype
    tc = [[x.astype(cd) for x in row] for row in _block_unit_lower_inverse(a, split)]
    _store_lower(t_ref, tc)
    v = _blocks(v_ref, per_key)
    _store_blocks(u_ref, _lower_matmul(tc, [(x.astype(F32) * bx[:, None]).astype(cd)
                                            for x, bx in zip(v, b, strict=True)]))
    _store_blocks(w_ref, _lower_matmul(tc, [(x.astype(F32) * bx[:, None] * _col(jnp.exp(g))).astype(cd)
                                            for x, bx, g in zip(k, b, gam, strict=True)]))
    if p_ref is not None:
        _store_lower(p_ref, _output_gram(_blocks(q_ref, per_key), k, gam, scale, f32_decay, span))


def _output_gram(q: list, k: list, gam: list, scale: float, f32_decay: bool, span: float) -> list[list[jax.Array]]:
    """The output's ``P = incl_lower(scale Q K^T decay)`` over row blocks, in the input dtype."""
    return [[(x * scale).astype(q[0].dtype) for x in row]
            for row in _block_gram(q, k, gam, strict=False, f32_operands=f32_decay, span=span)]


def _state_kernel(*refs, chunk: int, n_chunks: int, delta: bool, scale: float | None = None):
    """Sequential over chunks for one (batch, head, V-tile): h snapshots, v_new, final state; with ``scale`` (delta
    rule, ``RecurrentConfig.output_in_state``; inputs ``q``, ``P`` after ``h0``, output ``o`` after ``v_new``) also
    this V tile of ``o = (scale Q exp(gamma)) h + P v_new``, from the carried float32 state (rounded as the
    snapshot is)."""
    with_o = scale is not None
    k_ref, gam_ref, *refs = refs
    w_ref = refs.pop(0) if delta else None
    u_ref, h0_ref, *refs = refs
    q_ref, p_ref = (refs.pop(0), refs.pop(0)) if with_o else (None, None)
    h_ref = refs.pop(0)
    vn_ref = refs.pop(0) if delta else None
    o_ref = refs.pop(0) if with_o else None
    (ht_ref,) = refs
    cd = k_ref.dtype

    def body(c, s):
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        h_ref[c] = s.astype(h_ref.dtype)
        k = k_ref[rows, :]
        gam = gam_ref[rows]
        gl = _row(gam, -1)
        vn = u_ref[rows, :].astype(F32)
        if delta:
            vn = vn - _dot(w_ref[rows, :], s.astype(cd))
            vn_ref[rows, :] = vn.astype(vn_ref.dtype)
        if with_o:
            qd = (q_ref[rows, :].astype(F32) * scale * _col(jnp.exp(gam))).astype(cd)
            o_ref[rows, :] = (_dot(qd, s.astype(cd)) + _dot(p_ref[rows, :], vn.astype(cd))).astype(o_ref.dtype)
        k_end = (k.astype(F32) * _col(jnp.exp(gl - gam))).astype(cd)
        return _state_decay(gl) * s + _dot(k_end.T, vn.astype(cd))

    ht_ref[...] = lax.fori_loop(0, n_chunks, body, h0_ref[...].astype(F32))


def _output_kernel(q_ref, k_ref, vn_ref, gam_ref, h_ref, o_ref, *p_ref, scale: float, f32_decay: bool,
                   span: float):
    """One chunk: ``o = (scale Q exp(gamma)) h + P v_new``, ``P = incl_lower(scale Q K^T decay)``; with a
    per-key gate ``P`` is also stored (``p_ref``) for the reverse state pass."""
    per_key = len(gam_ref.shape) == 2
    q, gam, k = (_blocks(r, per_key) for r in (q_ref, gam_ref, k_ref))  # order of use and operations: _wy_kernel
    cd = q[0].dtype
    p = _output_gram(q, k, gam, scale, f32_decay, span)
    if p_ref:
        _store_lower(p_ref[0], p)
    qd = [(x.astype(F32) * scale * _col(jnp.exp(g))).astype(cd) for x, g in zip(q, gam, strict=True)]
    qh = [_dot(x, h_ref[...]) for x in qd]
    _store_blocks(o_ref, [x + y for x, y in zip(qh, _lower_matmul(p, _blocks(vn_ref, per_key)), strict=True)])


def _state_bwd_kernel(*refs, chunk: int, n_chunks: int, scale: float, delta: bool, hdh: bool, has_p: bool):
    """Reverse sequential pass for one (batch, head, V-tile).

    Per chunk (last to first), with ``ds`` the gradient of the state at the chunk's end::

        d(v_new) = P^T dO + K_end ds;   ds <- exp(gamma_last) ds + (scale Q exp(gamma))^T dO - w^T d(v_new)

    ``hdh``: also ``sum_v h ds`` (this V tile's part), with ``h`` the state at the chunk's start (the forward's
    snapshot): the gradient pass's ``d(gamma_last)`` term of the state decay. ``has_p``: ``P`` is an input (stored by
    the forward), else it is recomputed per chunk (scalar gate only).
    """
    q_ref, k_ref, gam_ref, *refs = refs
    w_ref = refs.pop(0) if delta else None
    p_ref = refs.pop(0) if has_p else None
    do_ref, dht_ref, *refs = refs
    h_ref = refs.pop(0) if hdh else None
    dh_ref, dvn_ref, dh0_ref = refs[:3]
    hdh_ref = refs[3] if hdh else None
    cd = q_ref.dtype
    i, j = _iota(chunk)

    def body(step, ds):
        c = n_chunks - 1 - step
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        dh_ref[c] = ds.astype(dh_ref.dtype)
        if hdh:
            hdh_ref[pl.ds(c, 1), :] = jnp.sum(h_ref[c].astype(F32) * ds, axis=1)[None, :]
        q = q_ref[rows, :]
        k = k_ref[rows, :]
        gam = gam_ref[rows]
        gl = _row(gam, -1)
        do = do_ref[rows, :]
        if p_ref is None:
            p_t = (_dot(k, q.T) * _masked_exp(gam[None, :] - gam[:, None], i <= j) * scale).astype(cd)
        else:
            p_t = p_ref[rows, :].T
        k_end = (k.astype(F32) * _col(jnp.exp(gl - gam))).astype(cd)
        dvn = _dot(p_t, do) + _dot(k_end, ds.astype(cd))
        dvn_ref[rows, :] = dvn.astype(dvn_ref.dtype)
        qd = (q.astype(F32) * scale * _col(jnp.exp(gam))).astype(cd)
        ds = _state_decay(gl) * ds + _dot(qd.T, do)
        if delta:
            ds = ds - _dot(w_ref[rows, :].T, dvn.astype(cd))
        return ds

    dh0_ref[...] = lax.fori_loop(0, n_chunks, body, dht_ref[...].astype(F32))


def _gram_vjp(m: list, a: list, b: list, gam: list, strict: bool, span: float = 0.0):
    """Gradients of ``G = _block_gram(a, b, gam, strict)`` for ``dG = m`` (lower block-triangular):
    ``(da, db, dgamma)`` lists of float32 blocks (``dgamma`` in the gate's shape); ``span``: see
    :func:`_one_matmul_pairs`."""
    if gam[0].ndim == 2:
        da = _block_decay_matmul(m, b, gam, strict, transpose=False, span=span)
        db = _block_decay_matmul(m, a, gam, strict, transpose=True, span=span)
        return da, db, [x.astype(F32) * dx - y.astype(F32) * dy for x, dx, y, dy in zip(a, da, b, db, strict=True)]
    m, (a,), (b,), (gam,) = m[0][0], a, b, gam  # a scalar gate: the chunk is one block
    cd = a.dtype
    dm = m * _masked_exp(gam[:, None] - gam[None, :], _tri(a.shape[0], strict))
    z = dm * _dot(a, b.T)  # dG * G
    return [_dot(dm.astype(cd), b)], [_dot(dm.T.astype(cd), a)], [jnp.sum(z, axis=1) - jnp.sum(z, axis=0)]


class _Snapshots:
    """One chunk's state snapshots ``h`` (its start state) and ``dh`` (the gradient of its end state), ``[K, V]``
    each, in the products the gradient kernels take of them; each tile is loaded where it is first used (with
    loads up front the anchor's gradient launch took 247 registers instead of 178, compiled for sm90). ``hdh_ref``:
    ``sum_v h dh`` ``[K]`` from the reverse state pass, if it computed it (:func:`hdh_in_state_bwd`)."""

    def __init__(self, h_ref, dh_ref=None, hdh_ref=None):
        self.refs, self.tiles, self.hdh_ref = {"h": h_ref, "dh": dh_ref}, {}, hdh_ref

    def _tile(self, name: str) -> jax.Array:
        if name not in self.tiles:
            self.tiles[name] = self.refs[name][...]
        return self.tiles[name]

    def times_h(self, x: jax.Array) -> jax.Array:
        """``x h^T`` (float32 ``[S, K]``) for ``x [S, V]``."""
        return _dot(x, self._tile("h").T)

    def times_dh(self, x: jax.Array) -> jax.Array:
        """``x dh^T`` (float32 ``[S, K]``) for ``x [S, V]``."""
        return _dot(x, self._tile("dh").T)

    def hdh(self) -> jax.Array:
        """``sum_v h dh`` (float32 ``[K]``; single-axis reductions only, for the Triton lowering)."""
        if self.hdh_ref is not None:
            return self.hdh_ref[...]
        return jnp.sum(self._tile("h").astype(F32) * self._tile("dh").astype(F32), axis=1)


def _grad_through_output(q: list, k: list, gam: list, snap: _Snapshots, vn: list, do: list, scale: float,
                         span: float):
    """One chunk's gradients through the output and the state update: ``(dq, dk, d(gamma))`` float32 blocks, the last
    row's d(gamma) including the chunk-end decay term. Without the delta rule this is the whole gradient.
    ``snap``: the state snapshots. ``span``: see :func:`_one_matmul_pairs`."""
    # The order of the operations is the one the Triton compiler was tuned with (see _wy_kernel).
    qf, kf = [x.astype(F32) for x in q], [x.astype(F32) for x in k]
    per_key = gam[0].ndim == 2
    gl = _row(gam[-1], -1)

    # o = (scale Q exp(gamma)) h + P v_new,  P = scale _gram(Q, K) (inclusive lower)
    dq = [snap.times_h(x) * scale * _col(jnp.exp(g)) for x, g in zip(do, gam, strict=True)]
    dgam = [_red(dx * x, per_key) for dx, x in zip(dq, qf, strict=True)]
    dp = [[_dot(do[i], vn[j].T) * scale for j in range(i + 1)] for i in range(len(do))]
    dq_p, dk, dgam_p = _gram_vjp(dp, q, k, gam, strict=False, span=span)
    dq = [x + y for x, y in zip(dq, dq_p, strict=True)]
    dgam = [x + y for x, y in zip(dgam, dgam_p, strict=True)]

    # h' = exp(gamma_last) h + (K exp(gamma_last - gamma))^T v_new
    r_sum = []
    for i in range(len(k)):
        e_end = _col(jnp.exp(gl - gam[i]))
        dk_end = snap.times_dh(vn[i])
        dk[i] = dk[i] + dk_end * e_end
        r = _red(dk_end * kf[i] * e_end, per_key)
        dgam[i] = dgam[i] - r
        r_sum.append(jnp.sum(r, axis=0))
    hdh = snap.hdh()
    dgl = _sum(r_sum) + (hdh if per_key else jnp.sum(hdh)) * jnp.exp(gl)
    idx = lax.broadcasted_iota(jnp.int32, gam[-1].shape, 0)
    dgam[-1] = jnp.where(idx == gam[-1].shape[0] - 1, dgam[-1] + dgl, dgam[-1])
    return dq, dk, dgam


def _grad_through_wy(k: list, v: list, b: list, gam: list, vn: list, tc: list, snap: _Snapshots, dvn: list,
                     first=None, span: float = 0.0):
    """One chunk's gradients through ``v_new = u - w h`` and the WY transform (delta rule):
    ``(dk, d(gamma), dv, dbeta)`` float32 blocks, to add to :func:`_grad_through_output`'s. ``tc``: ``T``'s lower
    blocks; ``vn``: ``v_new``'s blocks (``u`` and ``w`` are not needed, see below); ``snap``: the state snapshot.
    With the key dim tiled, ``k``, ``gam`` and the snapshot are one K tile's, dbeta is that tile's partial sum, and
    ``first`` says whether it is the first tile (which alone counts dbeta's value-space term). ``span``: see
    :func:`_one_matmul_pairs`."""
    cd = k[0].dtype
    kf = [x.astype(F32) for x in k]
    per_key = gam[0].ndim == 2
    eg = [_col(jnp.exp(g)) for g in gam]
    b = [x.astype(F32) for x in b]
    # v_new = u - w h;  u = T (beta V);  w = T (beta exp(gamma) K);  T = (I + A)^-1. With du = dv_new and
    # dw = -dv_new h^T: T^T dw = -(T^T du) h^T, and dA = -T^T dT T^T = -(T^T du) u^T - (T^T dw) w^T
    # = -(T^T du) (u - w h)^T = -(T^T du) v_new^T (restricted to the strict lower triangle)
    t_du = _lower_matmul_t(tc, [x.astype(cd) for x in dvn])
    t_dw = [-snap.times_h(x.astype(cd)) for x in t_du]
    dk, dgam, dv, db = [], [], [], []
    for i in range(len(k)):
        dv.append(t_du[i] * b[i][:, None])
        x = t_dw[i] * kf[i] * eg[i]
        dk.append(t_dw[i] * b[i][:, None] * eg[i])
        db_v = jnp.sum(t_du[i] * v[i].astype(F32), axis=1)
        db.append((db_v if first is None else jnp.where(first, db_v, 0.0)) + jnp.sum(x, axis=1))
        dgam.append(_red(x * b[i][:, None], per_key))
    # A = beta_i _gram(K, K): dbeta_i = sum_j dA_ij G_ij, dG = beta_i dA_ij
    da = [[-_dot(t_du[i].astype(cd), vn[j].T) for j in range(i + 1)] for i in range(len(k))]
    if per_key:
        y = _block_decay_matmul(da, k, gam, strict=True, transpose=False, span=span)  # (dA . decay) K
        db = [x + jnp.sum(yi * ki, axis=1) for x, yi, ki in zip(db, y, kf, strict=True)]
        z = _block_decay_matmul([[x * b[i][:, None] for x in row] for i, row in enumerate(da)], k, gam, strict=True,
                                transpose=True, span=span)
        for i in range(len(k)):
            dk[i] = dk[i] + y[i] * b[i][:, None] + z[i]
            dgam[i] = dgam[i] + kf[i] * (y[i] * b[i][:, None] - z[i])
    else:  # one block
        db[0] = db[0] + jnp.sum(da[0][0] * _gram(k[0], k[0], gam[0], strict=True), axis=1)
        (dk_row,), (dk_col,), (dgam_a,) = _gram_vjp([[da[0][0] * b[0][:, None]]], k, k, gam, strict=True)
        dk[0] = dk[0] + dk_row + dk_col
        dgam[0] = dgam[0] + dgam_a
    return dk, dgam, dv, db


def _first_k_tile(tiled: bool, first=None):
    """With the key dim tiled, whether this program has the first K tile, else None. ``first``: that, read by a
    caller that runs the kernel under ``pl.when`` (interpret mode reads program ids only outside it)."""
    if not tiled:
        return None
    return pl.program_id(3) == 0 if first is None else first


def _store_once(first, ref, blocks: list[jax.Array]) -> None:
    """Store value-space blocks, the same in every K tile: in the first tile only when the key dim is tiled
    (``first`` a traced bool; None: not tiled)."""
    if first is None:
        _store_blocks(ref, blocks)
    else:
        pl.when(first)(lambda: _store_blocks(ref, blocks))


def _grad_kernel(*refs, scale: float, delta: bool, tiled: bool, span: float, hdh: bool, first=None):
    """One chunk (and, ``tiled``, one K tile): dq, dk, d(gamma) and, with ``delta``, also dv and dbeta (the WY part
    fused in). ``span``: see :func:`_one_matmul_pairs`; ``hdh``: ``sum_v h dh`` is an input (the last one)."""
    if delta:
        q_ref, k_ref, v_ref, beta_ref, gam_ref, t_ref, h_ref, dh_ref, vn_ref, dvn_ref, do_ref, *refs = refs
    else:
        q_ref, k_ref, gam_ref, h_ref, dh_ref, vn_ref, do_ref, *refs = refs
    hdh_ref = refs.pop(0) if hdh else None
    if delta:
        dq_ref, dk_ref, dgam_ref, dv_ref, dbeta_ref = refs
    else:
        dq_ref, dk_ref, dgam_ref = refs
    per_key = len(gam_ref.shape) == 2
    first = _first_k_tile(tiled, first)
    k, gam, vn, do = (_blocks(r, per_key) for r in (k_ref, gam_ref, vn_ref, do_ref))
    dvn = _blocks(dvn_ref, per_key) if delta else None
    snap = _Snapshots(h_ref, dh_ref, hdh_ref)
    dq, dk, dgam = _grad_through_output(_blocks(q_ref, per_key), k, gam, snap, vn, do, scale, span)
    if delta:
        dk_wy, dgam_wy, dv, dbeta = _grad_through_wy(
            k, *(_blocks(r, per_key) for r in (v_ref, beta_ref)), gam, vn, _load_lower(t_ref, per_key), snap, dvn,
            first, span)
        _store_once(first, dv_ref, dv)
        _store_blocks(dbeta_ref, dbeta)
        dk = [x + y for x, y in zip(dk, dk_wy, strict=True)]
        dgam = [x + y for x, y in zip(dgam, dgam_wy, strict=True)]
    _store_blocks(dq_ref, dq)
    _store_blocks(dk_ref, dk)
    _store_blocks(dgam_ref, dgam)


def _grad_wy_kernel(k_ref, v_ref, beta_ref, gam_ref, vn_ref, t_ref, h_ref, dvn_ref, dk_in_ref, dgam_in_ref,
                    dk_ref, dgam_ref, dv_ref, dbeta_ref, *, tiled: bool, span: float, first=None):
    """One chunk (and, ``tiled``, one K tile), the WY part alone (the split gradient pass's second launch): dk and
    d(gamma), added to the first launch's (``dk_in``, ``dgam_in``), dv, dbeta. ``span``: see
    :func:`_one_matmul_pairs`."""
    per_key = len(gam_ref.shape) == 2
    first = _first_k_tile(tiled, first)
    k, v, beta, gam, vn, dvn = (_blocks(r, per_key) for r in (k_ref, v_ref, beta_ref, gam_ref, vn_ref, dvn_ref))
    dk, dgam, dv, dbeta = _grad_through_wy(k, v, beta, gam, vn, _load_lower(t_ref, per_key), _Snapshots(h_ref), dvn,
                                           first, span)
    _store_blocks(dk_ref, [x + y for x, y in zip(dk, _blocks(dk_in_ref, per_key), strict=True)])
    _store_blocks(dgam_ref, [x + y for x, y in zip(dgam, _blocks(dgam_in_ref, per_key), strict=True)])
    _store_once(first, dv_ref, dv)
    _store_blocks(dbeta_ref, dbeta)


# ------------------------------------------------------------------------------------------------ pallas calls


def _call(kernel, name: str, launch: Launch, st: Static, grid, in_specs, out_specs, out_shape, aliases=None):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases or {},
        compiler_params=pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=st.interpret,
        name=name,
    )


def _span(st: Static, gam, dtype) -> float:
    """``cfg.one_reference_span`` where one-reference diagonal blocks apply: a per-key gate and bf16 or float32
    inputs (factors up to ``exp(span)``); else 0 (the levels)."""
    span = float(st.cfg.one_reference_span)
    return span if gam.ndim == 4 and span > 0 and _wide_exponent(dtype) else 0.0


def _far_blocks(gam: list[jax.Array], span: float, causal: bool) -> list[jax.Array]:
    """``[SUB]`` bool per row block of a chunk's per-key gate: the rows that one-reference diagonal blocks get wrong.
    A row is far once some key channel's gate has moved by ``span`` or more from its block's first row. ``causal``
    (forward): that row and every later row of the chunk (``T`` carries a wrong row into the later ones), so no
    row's choice reads a later gate; else (gradient pass, whose diagonal products mix a block's rows): every row of
    that block."""
    far, carry = [], None
    for g in gam:
        moved = (jnp.max(jnp.abs(g - _row(g, 0)[None, :]), axis=1) >= span).astype(F32)
        if causal:  # any row j <= i, and any row of an earlier block
            f = jnp.max(jnp.where(_tri(g.shape[0], strict=False), moved[None, :], 0.0), axis=1)
            f = f if carry is None else jnp.maximum(f, carry)
            carry = _row(f, -1)
        else:
            f = jnp.zeros_like(moved) + jnp.max(moved)
        far.append(f > 0)
    return far


class _FarRowsOnly:
    """An output ref whose row-block stores (``ref[pl.ds(i * SUB, SUB), ...] = x``) change only the rows that
    ``far[i]`` marks: the others keep what the ref holds (the one-reference launch's values, aliased)."""

    def __init__(self, ref, far: list[jax.Array]):
        self.ref, self.far, self.shape, self.dtype = ref, far, ref.shape, ref.dtype

    def __setitem__(self, idx, x):
        rows = idx[0]
        far = self.far[rows.start // rows.size]
        self.ref[idx] = jnp.where(far.reshape(far.shape + (1,) * (x.ndim - 1)), x.astype(self.dtype), self.ref[idx])


class _ChunkOf:
    """Chunk ``r`` of a ref that spans several consecutive chunks on its first axis, indexed as the ref of one chunk:
    ``rows`` (a ``[R * C, ...]`` tile: rows ``r * C ...``) or not (a ``[R, ...]`` tile of per-chunk entries, such as
    state snapshots: entry ``r``). ``r`` may be traced."""

    def __init__(self, ref, r, C: int, rows: bool):
        self.ref, self.r, self.C, self.rows, self.dtype = ref, r, C, rows, ref.dtype
        self.shape = (C,) + tuple(ref.shape[1:]) if rows else tuple(ref.shape[1:])

    def _index(self, idx) -> tuple:
        idx = () if idx is Ellipsis else idx if isinstance(idx, tuple) else (idx,)
        if not self.rows:
            return (self.r,) + idx
        first = idx[0] if idx else slice(None)
        if isinstance(first, slice):  # the whole chunk (only ':' is used)
            return (pl.ds(self.r * self.C, self.C),) + idx[1:] + (slice(None),) * (len(self.shape) - max(len(idx), 1))
        return (pl.ds(self.r * self.C + first.start, first.size),) + idx[1:]

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, x):
        self.ref[self._index(idx)] = x


def _chunk_by_chunk(*refs, kernel, chunk: int, rows: tuple[bool, ...], n_chunks: int, tiled: bool, first=None,
                    when=None):
    """``kernel`` run on each of a program's ``n_chunks`` consecutive chunks in turn (``RecurrentConfig.
    chunks_per_program``, and the levels launches); ``refs`` (inputs, then outputs) span those chunks
    (:class:`_ChunkOf`, ``rows`` per ref). ``tiled``, ``first``: see :func:`_first_k_tile`; ``when``: ``r -> bool``,
    run on chunk ``r`` only where it holds (default: on every chunk)."""
    kw = {"first": _first_k_tile(True, first)} if tiled else {}

    def one_chunk(r, carry):
        def run():
            kernel(*(_ChunkOf(x, r, chunk, row) for x, row in zip(refs, rows, strict=True)), **kw)

        if when is None:
            run()
        else:
            pl.when(when(r))(run)
        return carry

    lax.fori_loop(0, n_chunks, one_chunk, 0)


def _levels_on_far_rows(*refs, kernel, n_in: int, gam_index: int, span: float, causal: bool, tiled: bool,
                        chunk: int, rows: tuple[bool, ...], summed: bool):
    """``kernel`` with the levels over the chunks of one program (:func:`_diagonal_launches`), run only on the chunks
    that have far rows (:func:`_far_blocks`), storing only those rows. ``refs``: the ``n_in`` inputs, the far-chunk
    flags of the program's chunks (:func:`_far_chunks`), the one-reference launch's outputs (aliased to this launch's
    outputs, through which :class:`_FarRowsOnly` reads them), this launch's outputs; each spans the program's chunks
    (:class:`_ChunkOf`, ``rows``: per input, then per output). ``tiled``: the grid has a K-tile axis
    (:func:`_first_k_tile`); ``summed``: the gate input is the raw gate, summed in the kernel
    (:func:`gate_sums_in_kernels`)."""
    n_out = (len(refs) - n_in - 1) // 2
    ins, flags, outs = refs[:n_in], refs[n_in], refs[n_in + 1 + n_out:]

    def redo_far_rows(*views, **kw):
        gate = _SummedGate(views[gam_index]) if summed else views[gam_index]
        far = _far_blocks(_blocks(gate, per_key=True), span, causal)
        kernel(*views[:n_in], *(_FarRowsOnly(x, far) for x in views[n_in:]), **kw)

    pl.when(jnp.max(flags[...]) > 0)(functools.partial(
        _chunk_by_chunk, *ins, *outs, kernel=redo_far_rows, chunk=chunk, rows=rows, n_chunks=flags.shape[0],
        tiled=tiled, first=_first_k_tile(tiled),  # program ids are read outside pl.when (interpret mode)
        when=lambda r: jnp.max(flags[pl.ds(r, 1)]) > 0))


def _far_chunks(gam: jax.Array, span: float, C: int, BK: int, cumulated: bool = True) -> jax.Array:
    """XLA: ``[B, HV, K // BK, N]`` float32, 1 where a chunk (of ``C`` rows) has, in a K tile of ``BK`` channels, a
    row whose gate has moved by about ``span`` or more from its ``SUB``-row block's first row (the rows
    :func:`_far_blocks` marks; the threshold is a little lower, so that no such chunk is missed by rounding).
    ``cumulated=False``: ``gam`` is the raw gate (:func:`gate_sums_in_kernels`); a block is then flagged where the
    sum of ``|g|`` over its rows after the first reaches the threshold, a bound on how far any row moves (the same
    blocks for a gate <= 0, some more for a gate of either sign)."""
    B, T, HV, K = gam.shape
    g = gam.reshape(B, T // SUB, SUB, HV, K)
    if cumulated:
        moved = jnp.abs(g - g[:, :, :1]) >= span * (1 - 2.0**-10)
    else:
        moved = jnp.sum(jnp.abs(g[:, :, 1:]), axis=2, keepdims=True) >= span * (1 - 2.0**-10)
    far = jnp.any(moved.reshape(B, T // C, -1, HV, K // BK, BK), axis=(2, 5))  # [B, N, HV, NK]
    return far.transpose(0, 2, 3, 1).astype(F32)


def gate_sums_in_kernels(cfg: RecurrentConfig, per_key: bool, C: int) -> bool:
    """Whether the kernels take the raw gate and sum it per chunk themselves (``cfg.gate_cumsum_in_kernels``): with a
    per-key gate at chunk ``SUB`` only, where a chunk is one row block, so that the gradient pass's levels launch,
    which rewrites whole blocks, also rewrites every row the reverse sum of the gate's gradient mixes. At other
    chunks XLA sums the gate (:func:`chunk_local_cumsum`), as without the option."""
    return cfg.gate_cumsum_in_kernels and per_key and C == SUB


def kernel_gate(g: jax.Array, C: int, cfg: RecurrentConfig) -> jax.Array:
    """XLA: the gate the kernels take, from ``g [B,T,HV]`` or ``[B,T,HV,K]`` float32 (T a multiple of ``C``): its chunk
    sums (:func:`chunk_local_cumsum`), or ``g`` itself where the kernels sum it (:func:`gate_sums_in_kernels`)."""
    return g if gate_sums_in_kernels(cfg, g.ndim == 4, C) else chunk_local_cumsum(g, C)


def _inclusive_sums(x: jax.Array, reverse: bool) -> jax.Array:
    """``[S, D]`` -> float32 inclusive sums over rows (``reverse``: of each row and the later ones), by an ``[S, S]``
    triangular matmul in IEEE float32 (the operands are not rounded)."""
    i, j = _iota(x.shape[0])
    return _dot(((i <= j) if reverse else (i >= j)).astype(F32), x.astype(F32), lax.Precision.HIGHEST)


class _SummedGate:
    """A ref of the raw gate read as the cumulated one: a load of a chunk's ``SUB`` rows returns their inclusive sums
    (:func:`gate_sums_in_kernels`)."""

    def __init__(self, ref):
        self.ref, self.shape, self.dtype = ref, ref.shape, ref.dtype

    def __getitem__(self, idx):
        return _inclusive_sums(self.ref[idx], reverse=False)


class _ReverseSummedGrad:
    """The gate-gradient output ref where the kernels sum the gate: a store of a chunk's ``d(gamma)`` rows writes the
    raw gate's gradient, their reverse inclusive sums."""

    def __init__(self, ref):
        self.ref, self.shape, self.dtype = ref, ref.shape, ref.dtype

    def __setitem__(self, idx, x):
        self.ref[idx] = _inclusive_sums(x, reverse=True).astype(self.ref.dtype)


def _summing_gate(kernel, st: Static, gam: jax.Array, gate: int, dgate: int | None = None):
    """``kernel``, where the kernels sum the gate ``gam`` (:func:`gate_sums_in_kernels`) with its ref ``gate`` read
    through :class:`_SummedGate` and, ``dgate`` given, its ref ``dgate`` stored through :class:`_ReverseSummedGrad`;
    else ``kernel`` itself."""
    if not gate_sums_in_kernels(st.cfg, gam.ndim == 4, st.chunk):
        return kernel

    def summing(*refs, **kw):
        refs = list(refs)
        refs[gate] = _SummedGate(refs[gate])
        if dgate is not None:
            refs[dgate] = _ReverseSummedGrad(refs[dgate])
        return kernel(*refs, **kw)

    return summing


def _over_chunks(spec: pl.BlockSpec, R: int) -> pl.BlockSpec:
    """A chunk-parallel BlockSpec (chunk ``c`` on axis 1: ``C`` rows, or one squeezed entry) over ``R`` consecutive
    chunks: grid index ``p`` of that axis covers chunks ``p R ... p R + R - 1``."""
    shape = list(spec.block_shape)
    moves = [x != y for x, y in zip(spec.index_map(0, 0, 1, 0), spec.index_map(0, 0, 0, 0), strict=True)]
    if moves != [axis == 1 for axis in range(len(shape))]:
        raise ValueError(f"a chunk-parallel BlockSpec must follow the chunk on axis 1 only: {spec}")
    shape[1] = R if shape[1] is None else shape[1] * R
    return pl.BlockSpec(tuple(shape), spec.index_map)


def _diagonal_launches(kernel, name: str, launch: Launch, st: Static, grid, in_specs, out_specs, out_shape, *,
                       gam_index: int, causal: bool, redo_far: bool, dgate: int | None = None, per_program: int = 1):
    """-> ``fn(*inputs)``: the launches of a kernel with diagonal row blocks (``kernel(*refs, span=...)``,
    :func:`_block_gram`; ``inputs[gam_index]`` is the gate; ``grid`` ``[B, HV, N]`` or ``[B, HV, N, NK]``). With a
    per-key gate (:func:`_span`) two: one around one reference row per block (``name``), then one with the levels
    (``name_levels``) which redoes, in place, the rows the first gets wrong (:func:`_far_blocks`; its outputs are
    aliased to the first's). Each of its programs takes ``cfg.levels_chunks`` consecutive chunks (the largest power
    of two up to that which divides N) and, unless XLA flagged one of them (:func:`_far_chunks`), exits after one
    load. With a gate that moves by less than the span within every 16 rows (the usual case) that is all the second
    launch does; no host round trip decides whether it runs. ``redo_far=False``: the first launch alone (its far rows
    wrong; for tests). Otherwise one launch with the levels. Where the kernels sum the gate
    (:func:`gate_sums_in_kernels`) the kernel reads ``inputs[gam_index]`` as sums and, ``dgate`` given, stores its
    output ``dgate`` (the gate's gradient) reverse-summed (:func:`_summing_gate`). ``per_program``: chunks per program
    of the first launch (:func:`chunks_per_program`; the greatest common divisor of it and N), looped over in turn."""

    def run(*inputs):
        span = _span(st, inputs[gam_index], inputs[0].dtype)
        n_in = len(inputs)
        summed = gate_sums_in_kernels(st.cfg, inputs[gam_index].ndim == 4, st.chunk)
        kernel_ = _summing_gate(kernel, st, inputs[gam_index], gam_index, None if dgate is None else n_in + dgate)
        N = grid[2]
        rows = tuple(spec.block_shape[1] is not None for spec in in_specs + out_specs)
        P = math.gcd(N, per_program)
        if P > 1:
            first = _call(functools.partial(_chunk_by_chunk, kernel=functools.partial(kernel_, span=span),
                                            chunk=st.chunk, rows=rows, n_chunks=P, tiled=len(grid) == 4),
                          name, launch, st, grid[:2] + (N // P,) + grid[3:],
                          [_over_chunks(spec, P) for spec in in_specs], [_over_chunks(spec, P) for spec in out_specs],
                          out_shape)
        else:
            first = _call(functools.partial(kernel_, span=span), name, launch, st, grid, in_specs, out_specs,
                          out_shape)
        if not span or not redo_far:
            return first(*inputs)
        R = math.gcd(N, 1 << (max(1, st.cfg.levels_chunks).bit_length() - 1))  # a power of two dividing N
        BK = in_specs[gam_index].block_shape[-1]
        flags = pl.BlockSpec((None, None, None, R), lambda b, h, p, kt=0: (b, h, kt, p))
        levels = functools.partial(_levels_on_far_rows, kernel=functools.partial(kernel_, span=0.0), n_in=n_in,
                                   gam_index=gam_index, span=span, causal=causal, tiled=len(grid) == 4,
                                   chunk=st.chunk, rows=rows, summed=summed)
        spans = [_over_chunks(spec, R) for spec in out_specs]
        return _call(levels, f"{name}_levels", launch, st, grid[:2] + (N // R,) + grid[3:],
                     [_over_chunks(spec, R) for spec in in_specs] + [flags] + spans, spans, out_shape,
                     {n_in + 1 + i: i for i in range(len(out_specs))}
                     )(*inputs, _far_chunks(inputs[gam_index], span, st.chunk, BK, cumulated=not summed),
                       *first(*inputs))

    return run


class _Specs:
    """BlockSpecs over the ``[B, T, heads, D]`` layout for chunk-parallel (grid ``[B, HV, N]``) and
    sequential (grid ``[B, HV, NV]``) kernels. q/k blocks read head ``hv // group``; the cumulated gate is
    ``[B, T, HV]`` or, per key (``gate_k`` = K), ``[B, T, HV, K]``."""

    def __init__(self, T: int, C: int, group: int, BV: int, gate_k: int | None):
        self.T, self.C, self.G, self.BV, self.gate_k = T, C, group, BV, gate_k

    def gate(self, D: int | None = None):
        """The cumulated gate; per key, ``D`` columns (default all) following the K tile."""
        return self.vec() if self.gate_k is None else self.key_tok(D or self.gate_k)

    def gate_seq(self):
        return self.vec_seq() if self.gate_k is None else self.tok_seq(self.gate_k)

    # chunk-parallel, grid [B, HV, N] or, with the key dim tiled (gradient pass), [B, HV, N, NK]: the K-dim tiles
    # (q/k, per-key gate, per-head K-dim tensors, snapshot rows) follow the K tile ``kt``, the others do not
    def qk(self, D):
        return pl.BlockSpec((None, self.C, None, D), lambda b, h, c, kt=0: (b, c, h // self.G, kt))

    def tok(self, D):
        return pl.BlockSpec((None, self.C, None, D), lambda b, h, c, *_: (b, c, h, 0))

    def key_tok(self, D):
        return pl.BlockSpec((None, self.C, None, D), lambda b, h, c, kt=0: (b, c, h, kt))

    def vec(self):
        return pl.BlockSpec((None, self.C, None), lambda b, h, c, *_: (b, c, h))

    def part(self):
        """One partial sum per K tile (``[B, T, HV, NK]``), summed by the caller."""
        return pl.BlockSpec((None, self.C, None, None), lambda b, h, c, kt: (b, c, h, kt))

    def snap(self, K, V):
        return pl.BlockSpec((None, None, None, K, V), lambda b, h, c, kt=0: (b, c, h, kt, 0))

    def chunk_keys(self, D):
        """A chunk's ``[K]`` vector in ``[B, N, HV, K]``, ``D`` entries following the K tile."""
        return pl.BlockSpec((None, None, None, D), lambda b, h, c, kt=0: (b, c, h, kt))

    # sequential over chunks, tiled over V
    def qk_seq(self, D):
        return pl.BlockSpec((None, self.T, None, D), lambda b, h, v: (b, 0, h // self.G, 0))

    def tok_seq(self, D):
        return pl.BlockSpec((None, self.T, None, D), lambda b, h, v: (b, 0, h, 0))

    def vtile_seq(self):
        return pl.BlockSpec((None, self.T, None, self.BV), lambda b, h, v: (b, 0, h, v))

    def vec_seq(self):
        return pl.BlockSpec((None, self.T, None), lambda b, h, v: (b, 0, h))

    def state_seq(self, K):
        return pl.BlockSpec((None, None, K, self.BV), lambda b, h, v: (b, h, 0, v))

    def keys_per_vtile_seq(self, N, K):
        """Every chunk's ``[K]`` vector of this V tile in ``[B, N, HV, V // BV, K]``."""
        return pl.BlockSpec((None, N, None, None, K), lambda b, h, v: (b, 0, h, v, 0))

    def snaps_seq(self, N, K):
        return pl.BlockSpec((None, N, None, K, self.BV), lambda b, h, v: (b, 0, h, 0, v))


def _gate_bytes(gam) -> int:
    """Bytes of one token's cumulated gate (float32): one per value head, or one per key channel."""
    return 4 * (gam.shape[3] if gam.ndim == 4 else 1)


def _dims(st: Static, q, v, gam, block_v: int | None = None):
    """Shapes, chunk count, V tile (``block_v``, default the config's, clipped to V) and BlockSpecs."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BV = min(block_v or st.cfg.block_v, V)
    return B, T, HV, K, V, T // st.chunk, BV, _Specs(T, st.chunk, HV // H, BV, K if gam.ndim == 4 else None)


# Stages: one pallas_call each, on padded arrays (benchmarks/autotune.py times them one by one).


def wy(st: Static, k, v, gam, beta, q=None, redo_far: bool = True):
    """-> ``u [B,T,HV,V]``, ``w [B,T,HV,K]``, ``T [B,T,HV,C]`` (row t of its chunk) and, with ``q``
    (``RecurrentConfig.output_in_state``), the output's ``P [B,T,HV,C]``, in the input dtype (T is computed in
    float32). ``redo_far``: see :func:`_diagonal_launches`."""
    B, T, HV, K, V, N, _, s = _dims(st, k, v, gam)
    sds = jax.ShapeDtypeStruct
    with_p = q is not None
    chunk_rows = sds((B, T, HV, st.chunk), k.dtype)
    return tuple(_diagonal_launches(
        functools.partial(_wy_kernel, split=st.cfg.inverse_bf16x3, f32_decay=st.cfg.decay_operands_f32,
                          scale=st.scale if with_p else None), "wy_fwd",
        st.cfg.wy, st, (B, HV, N),
        [s.qk(K), s.tok(V), s.gate(), s.vec()] + ([s.qk(K)] if with_p else []),
        [s.tok(V), s.tok(K), s.tok(st.chunk)] + ([s.tok(st.chunk)] if with_p else []),
        [sds((B, T, HV, V), k.dtype), sds((B, T, HV, K), k.dtype), chunk_rows] + ([chunk_rows] if with_p else []),
        gam_index=2, causal=True, redo_far=redo_far, per_program=chunks_per_program(st.cfg, K, V),
    )(k, v, gam, beta, *([q] if with_p else [])))


def state_fwd(st: Static, k, gam, w, u, h0, q=None, p=None):
    """-> ``h [B,N,HV,K,V]`` (state at each chunk start), ``v_new [B,T,HV,V]`` (delta rule only: ``w`` given,
    else ``u`` is V and is returned as v_new), final state ``[B,HV,K,V]`` float32 and, with ``q`` and ``P`` (from
    :func:`wy`; ``RecurrentConfig.output_in_state``), the output ``o [B,T,HV,V]`` (input dtype)."""
    B, T, HV, K, V, N, BV, s = _dims(st, k, u, gam)
    sds = jax.ShapeDtypeStruct
    delta = w is not None
    with_o = q is not None
    kernel = functools.partial(_state_kernel, chunk=st.chunk, n_chunks=N, delta=delta,
                               scale=st.scale if with_o else None)
    kernel = _summing_gate(kernel, st, gam, 1)
    snaps, final = sds((B, N, HV, K, V), k.dtype), sds((B, HV, K, V), F32)
    # one chunk's loads (k, gate, w, u tile; q, P): a pipeline stage's shared memory
    isz = k.dtype.itemsize
    stage = st.chunk * (K * isz * (2 if delta else 1) + _gate_bytes(gam) + BV * u.dtype.itemsize
                        + ((K + st.chunk) * isz if with_o else 0))
    launch = fit_stages(st.cfg.state, stage, st.cfg.shared_memory)
    ins = [k, gam] + ([w] if delta else []) + [u, h0] + ([q, p] if with_o else [])
    in_specs = [s.qk_seq(K), s.gate_seq()] + ([s.tok_seq(K)] if delta else []) + [s.vtile_seq(), s.state_seq(K)] + (
        [s.qk_seq(K), s.tok_seq(st.chunk)] if with_o else [])
    n_tiles = delta + with_o  # v_new, o: [B,T,HV,V] outputs in V tiles
    h, *tiles, ht = _call(
        kernel, "state_fwd", launch, st, (B, HV, V // BV), in_specs,
        [s.snaps_seq(N, K)] + [s.vtile_seq()] * n_tiles + [s.state_seq(K)],
        [snaps] + [sds((B, T, HV, V), k.dtype)] * n_tiles + [final],
    )(*ins)
    vn = tiles[0] if delta else u
    return (h, vn, ht, tiles[1]) if with_o else (h, vn, ht)


def output(st: Static, q, k, vn, gam, h, redo_far: bool = True):
    """-> ``o [B,T,HV,V]`` and, with a per-key gate, ``P [B,T,HV,C]`` (row t of its chunk, input dtype), else
    None. ``redo_far``: see :func:`_diagonal_launches`."""
    B, T, HV, K, V, N, _, s = _dims(st, q, vn, gam)
    sds = jax.ShapeDtypeStruct
    per_key = gam.ndim == 4
    outs = _diagonal_launches(
        functools.partial(_output_kernel, scale=st.scale, f32_decay=st.cfg.decay_operands_f32), "output_fwd",
        st.cfg.output, st, (B, HV, N),
        [s.qk(K), s.qk(K), s.tok(V), s.gate(), s.snap(K, V)],
        [s.tok(V)] + ([s.tok(st.chunk)] if per_key else []),
        [sds((B, T, HV, V), vn.dtype)] + ([sds((B, T, HV, st.chunk), q.dtype)] if per_key else []),
        gam_index=3, causal=True, redo_far=redo_far, per_program=chunks_per_program(st.cfg, K, V),
    )(q, k, vn, gam, h)
    return outs[0], (outs[1] if per_key else None)


def _head_dims_from(threshold: int | None, K: int, V: int) -> bool:
    """A config rule on the padded head dims: ``K * V`` at least ``threshold`` (``None``: never)."""
    return threshold is not None and K * V >= threshold


def chunks_per_program(cfg: RecurrentConfig, K: int, V: int) -> int:
    """Chunks each program of the chunk-parallel launches loops over (``K``, ``V``: padded head dims; see
    ``RecurrentConfig.chunks_per_program``): the config's where ``K * V`` reaches ``chunks_per_program_from``, else
    1."""
    return max(1, cfg.chunks_per_program) if _head_dims_from(cfg.chunks_per_program_from, K, V) else 1


def hdh_in_state_bwd(cfg: RecurrentConfig, K: int, V: int) -> bool:
    """Whether the reverse state pass computes the gradient pass's ``sum_v h dh`` (``K``, ``V``: padded head
    dims; see ``RecurrentConfig.state_bwd_hdh_from``)."""
    return _head_dims_from(cfg.state_bwd_hdh_from, K, V)


def state_bwd_block_v(cfg: RecurrentConfig, delta: bool) -> int:
    """The reverse state pass's V tile before clipping to V: ``cfg.block_v_bwd`` with the delta rule, if set, else
    ``cfg.block_v``."""
    return (cfg.block_v_bwd if delta else None) or cfg.block_v


def state_bwd(st: Static, q, k, gam, w, p, do, dht, h):
    """-> ``dh [B,N,HV,K,V]`` (gradient of each chunk's end state), ``d(v_new) [B,T,HV,V]`` float32, d(initial
    state) ``[B,HV,K,V]`` float32 and, if :func:`hdh_in_state_bwd`, ``hdh [B,N,HV,K]`` float32 (``sum_v h dh``
    per chunk, from the float32 ``dh``), else None. ``w`` is None without the delta rule; ``p`` (from
    :func:`output`, or from :func:`wy` with ``RecurrentConfig.output_in_state``) is given with a per-key gate and may
    be with a scalar one, else None (then recomputed); ``h``: the state snapshots (:func:`state_fwd`)."""
    delta = w is not None
    B, T, HV, K, V, N, BV, s = _dims(st, q, do, gam, state_bwd_block_v(st.cfg, delta))
    sds = jax.ShapeDtypeStruct
    hdh = hdh_in_state_bwd(st.cfg, K, V)
    kernel = functools.partial(_state_bwd_kernel, chunk=st.chunk, n_chunks=N, scale=st.scale, delta=delta, hdh=hdh,
                               has_p=p is not None)
    kernel = _summing_gate(kernel, st, gam, 2)
    ins = [q, k, gam] + ([w] if delta else []) + ([p] if p is not None else []) + [do, dht] + ([h] if hdh else [])
    specs = [s.qk_seq(K), s.qk_seq(K), s.gate_seq()] + ([s.tok_seq(K)] if delta else []) + (
        [s.tok_seq(st.chunk)] if p is not None else []) + [s.vtile_seq(), s.state_seq(K)] + (
        [s.snaps_seq(N, K)] if hdh else [])
    # one chunk's loads (q, k, gate, w, P, dO tile): a pipeline stage's shared memory (the snapshot tile read for
    # hdh is not staged: offline at the KDA anchor the launch's shared memory did not change)
    isz = q.dtype.itemsize
    stage = st.chunk * (K * isz * (3 if delta else 2) + _gate_bytes(gam) + (st.chunk * isz if p is not None else 0)
                        + BV * do.dtype.itemsize)
    outs = _call(
        kernel, "state_bwd", fit_stages(st.cfg.state_bwd, stage, st.cfg.shared_memory), st, (B, HV, V // BV), specs,
        [s.snaps_seq(N, K), s.vtile_seq(), s.state_seq(K)]
        + ([s.keys_per_vtile_seq(N, K)] if hdh else []),
        [sds((B, N, HV, K, V), q.dtype), sds((B, T, HV, V), F32), sds((B, HV, K, V), F32)]
        + ([sds((B, N, HV, V // BV, K), F32)] if hdh else []),
    )(*ins)
    return (*outs[:3], jnp.sum(outs[3], axis=3) if hdh else None)


def grad(st: Static, q, k, v, beta, gam, t, h, dh, hdh, vn, dvn, do, redo_far: bool = True):
    """-> per value head ``dq, dk [B,T,HV,K]``, ``d(gamma)`` (the gate's shape) and, with the delta rule
    (``beta`` given), ``dv [B,T,HV,V]`` and ``dbeta [B,T,HV]``, all float32.

    With the delta rule and ``K V >= cfg.split_grad_from``, two launches (``grad`` through the output and the
    state update, ``grad_wy`` through the WY transform, which adds the first's dk and d(gamma) to its own) instead
    of one, so that neither program holds every tile at once (the fused kernel spills registers at large K V). With
    ``cfg.block_k < K`` each launch has one program per (chunk, K tile); what sums over K (dbeta, a scalar gate's
    d(gamma)) comes out as one partial sum per tile, added here. ``hdh``: ``sum_v h dh`` from :func:`state_bwd`, or
    None (then ``grad`` computes it from the snapshots). ``redo_far``: see :func:`_diagonal_launches`."""
    B, T, HV, K, V, N, _, s = _dims(st, q, v, gam)
    sds = jax.ShapeDtypeStruct
    split = _head_dims_from(st.cfg.split_grad_from, K, V)
    delta = beta is not None
    BK = min(st.cfg.block_k or K, K)
    tiled = BK < K
    grid = (B, HV, N, K // BK) if tiled else (B, HV, N)
    parts = sds((B, T, HV, K // BK), F32)  # one partial sum per K tile
    dgam_parts = tiled and gam.ndim == 3  # a scalar gate's d(gamma) sums over K

    def summed(x, in_parts: bool):
        return jnp.sum(x, axis=-1) if in_parts else x

    out_specs = [s.key_tok(BK), s.key_tok(BK), s.part() if dgam_parts else s.gate(BK)]
    out_shape = [sds((B, T, HV, K), F32), sds((B, T, HV, K), F32), parts if dgam_parts else sds(gam.shape, F32)]
    wy_specs = [s.tok(V), s.part() if tiled else s.vec()]
    wy_shape = [sds((B, T, HV, V), F32), parts if tiled else sds((B, T, HV), F32)]
    hdh_in, hdh_specs = ([], []) if hdh is None else ([hdh], [s.chunk_keys(BK)])
    grad_kernel = functools.partial(_grad_kernel, scale=st.scale, tiled=tiled, hdh=hdh is not None)
    per_program = chunks_per_program(st.cfg, K, V)
    if not delta or split:
        dq, dk, dgam = _diagonal_launches(
            functools.partial(grad_kernel, delta=False), "grad_bwd", st.cfg.grad, st, grid,
            [s.qk(BK), s.qk(BK), s.gate(BK), s.snap(BK, V), s.snap(BK, V), s.tok(V), s.tok(V)] + hdh_specs,
            out_specs, out_shape, gam_index=2, causal=False, redo_far=redo_far, dgate=None if delta else 2,
            per_program=per_program,
        )(q, k, gam, h, dh, vn, do, *hdh_in)
        if not delta:
            return dq, dk, summed(dgam, dgam_parts)
        dk, dgam, dv, dbeta = _diagonal_launches(
            functools.partial(_grad_wy_kernel, tiled=tiled), "grad_wy_bwd", st.cfg.grad_wy, st, grid,
            [s.qk(BK), s.tok(V), s.vec(), s.gate(BK), s.tok(V), s.tok(st.chunk), s.snap(BK, V), s.tok(V)]
            + out_specs[1:], out_specs[1:] + wy_specs, out_shape[1:] + wy_shape, gam_index=3, causal=False,
            redo_far=redo_far, dgate=1, per_program=per_program,
        )(k, v, beta, gam, vn, t, h, dvn, dk, dgam)
        return dq, dk, summed(dgam, dgam_parts), dv, summed(dbeta, tiled)
    dq, dk, dgam, dv, dbeta = _diagonal_launches(
        functools.partial(grad_kernel, delta=True), "grad_bwd", st.cfg.grad, st, grid,
        [s.qk(BK), s.qk(BK), s.tok(V), s.vec(), s.gate(BK), s.tok(st.chunk), s.snap(BK, V), s.snap(BK, V),
         s.tok(V), s.tok(V), s.tok(V)] + hdh_specs,
        out_specs + wy_specs, out_shape + wy_shape, gam_index=4, causal=False, redo_far=redo_far, dgate=2,
        per_program=per_program,
    )(q, k, v, beta, gam, t, h, dh, vn, dvn, do, *hdh_in)
    return dq, dk, summed(dgam, dgam_parts), dv, summed(dbeta, tiled)


def _forward(st: Static, q, k, v, gam, beta, h0):
    """Padded inputs -> ``(o, final state, residuals)``."""
    if beta is not None and st.cfg.output_in_state:
        u, w, t, p = wy(st, k, v, gam, beta, q)
        h, vn, ht, o = state_fwd(st, k, gam, w, u, h0, q, p)
        return o, ht, (q, k, v, gam, beta, w, t, h, vn, p)
    u, w, t = wy(st, k, v, gam, beta) if beta is not None else (v, None, None)
    h, vn, ht = state_fwd(st, k, gam, w, u, h0)
    o, p = output(st, q, k, vn, gam, h)
    return o, ht, (q, k, v, gam, beta, w, t, h, vn, p)


def _backward(st: Static, res, do, dht):
    q, k, v, gam, beta, w, t, h, vn, p = res
    B, T, H, K = q.shape
    do = do.astype(q.dtype)
    dh, dvn, dh0, hdh = state_bwd(st, q, k, gam, w, p, do, dht, h)
    if beta is None:
        dq, dk, dgam = grad(st, q, k, v, None, gam, None, h, dh, hdh, vn, None, do)
        dv, dbeta = dvn, None
    else:
        dq, dk, dgam, dv, dbeta = grad(st, q, k, v, beta, gam, t, h, dh, hdh, vn, dvn, do)
        dbeta = dbeta.astype(beta.dtype)
    group = (B, T, H, v.shape[2] // H, K)
    dq = dq.reshape(group).sum(3).astype(q.dtype)
    dk = dk.reshape(group).sum(3).astype(k.dtype)
    return dq, dk, dv.astype(v.dtype), dgam, dbeta, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(st: Static, q, k, v, gam, beta, h0):
    o, ht, _ = _forward(st, q, k, v, gam, beta, h0)
    return o, ht


def _chunked_fwd(st: Static, q, k, v, gam, beta, h0):
    o, ht, res = _forward(st, q, k, v, gam, beta, h0)
    return (o, ht), res


def _chunked_bwd(st: Static, res, cts):
    do, dht = cts
    return _backward(st, res, do, dht.astype(F32))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ------------------------------------------------------------------------------------------------------ public


def _per_batch_shard(fn, batch: int):
    """``fn`` (arrays with a leading batch dim in and out) run on each device's batch shard when a mesh is set
    (``jax.set_mesh``) and its size divides the batch: XLA does not partition Pallas calls, so under a
    batch-sharded ``jit`` without this every device would gather and process the whole batch."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                 if kind != jax.sharding.AxisType.Manual)  # already inside a shard_map over the others
    size = math.prod(mesh.shape[name] for name in axes)
    if size == 1 or batch % size:
        return fn
    spec = jax.sharding.PartitionSpec(axes)
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names=set(axes), check_vma=False)


def chunk_local_cumsum(g: jax.Array, C: int) -> jax.Array:
    """XLA: the cumulative sum of a gate ``g [B, T, HV]`` or ``[B, T, HV, K]`` within each chunk of ``C`` tokens (T a
    multiple of C). A per-key gate's as a masked sum over a broadcast ``[B, N, C, C, HV, K]``, one fusion each way
    (its VJP is the same sum, transposed): ``jnp.cumsum`` lowers to a reduce-window that took 0.17 ms each way on an
    H200 at B8 T2048 HV16 K128 (8% of KDA's forward+backward), this form 0.08 ms. A scalar gate's, 1/K the size,
    stays ``jnp.cumsum`` (at GDN's chunk 64 the masked sum took 0.02 ms against 0.007). A per-key chunk longer than
    ``SUB`` rows is summed in ``SUB``-row blocks, each block then offset by the totals of the chunk's earlier blocks,
    so that the broadcast stays ``SUB`` x ``SUB`` per block at any chunk."""
    B, T = g.shape[:2]
    if g.ndim == 3:
        return jnp.cumsum(g.reshape(B, T // C, C, *g.shape[2:]), axis=2).reshape(g.shape)
    S = min(C, SUB)
    x = g.reshape(B, T // S, S, *g.shape[2:])
    i = jnp.arange(S)
    lower = (i[None, :] <= i[:, None])[None, None, :, :, None, None]
    local = jnp.sum(jnp.where(lower, x[:, :, None], 0.0), axis=3)  # [B, T/S, S, HV, K]
    if S == C:
        return local.reshape(g.shape)
    blocks = local.reshape(B, T // C, C // S, S, *g.shape[2:])
    totals = blocks[:, :, :-1, -1:]  # the sums of every block but the chunk's last
    # each block's offset: the sum of the chunk's earlier blocks only (an inclusive cumsum minus the block's own
    # total would round differently when a later gate changes: outputs would depend on later gates)
    offsets = jnp.concatenate([jnp.zeros_like(totals[:, :, :1]), jnp.cumsum(totals, axis=2)], axis=2)
    return (blocks + offsets).reshape(g.shape)


def _pow2_at_least_16(n: int) -> int:
    return max(16, pl.next_power_of_2(n))


def chunk_recurrence(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array | None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int | None = None,
    interpret: bool = False,
    config: RecurrentConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked GDN (``beta`` given, ``g [B,T,HV]``), KDA (``beta`` given, ``g [B,T,HV,K]``) or scalar-gated linear
    attention (``beta=None``) with Pallas kernels.

    Args:
      q, k: ``[B,T,H,K]``; v: ``[B,T,HV,V]`` (HV a multiple of H); g: ``[B,T,HV]`` or ``[B,T,HV,K]`` log decay;
      beta: ``[B,T,HV]`` or ``None``; initial_state: ``[B,HV,K,V]`` or ``None`` (zeros).
      chunk_size: a power of two >= 16; ``None``: the config's ``chunk`` (tuned per GPU and gate kind).
      interpret: run the kernels in Pallas interpret mode (CPU).
      config: launch parameters (default: ``tuning.recurrent_config()`` for the current device and gate kind).

    Returns ``(o [B,T,HV,V] in v's dtype, final_state [B,HV,K,V] float32)``, the same function as
    :func:`hybrid_jax.kernels.reference.naive_recurrence`, differentiable in every array argument.
    """
    config = config or recurrent_config(per_key=g.ndim == 4)
    C = config.chunk if chunk_size is None else chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {C}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = reference.l2_normalize(q).astype(q.dtype), reference.l2_normalize(k).astype(k.dtype)
    out_dtype = v.dtype
    cd = jnp.promote_types(q.dtype, v.dtype)
    q, k, v = q.astype(cd), k.astype(cd), v.astype(cd)
    Tp, Kp, Vp = -(-T // C) * C, _pow2_at_least_16(K), _pow2_at_least_16(V)

    def pad(x, *widths):
        return jnp.pad(x, [(0, 0)] + [(0, w) for w in widths]) if any(widths) else x

    q, k = pad(q, Tp - T, 0, Kp - K), pad(k, Tp - T, 0, Kp - K)
    v = pad(v, Tp - T, 0, Vp - V)
    g = pad(g.astype(F32), Tp - T, 0, *([Kp - K] if g.ndim == 4 else []))
    gam = kernel_gate(g, C, config)
    beta = None if beta is None else pad(beta, Tp - T, 0)
    h0 = jnp.zeros((B, HV, K, V), F32) if initial_state is None else initial_state.astype(F32)
    h0 = pad(h0, 0, Kp - K, Vp - V)
    st = Static(float(scale), C, config, interpret)
    o, ht = _per_batch_shard(functools.partial(_chunked, st), B)(q, k, v, gam, beta, h0)
    return o[:, :T, :, :V].astype(out_dtype), ht[:, :, :K, :V]
