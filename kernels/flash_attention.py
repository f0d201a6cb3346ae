"""Flash attention in Pallas (Triton lowering), forward and backward; qk head dim may differ from v's.

Shapes follow FLA: ``q, k: [B,T,H,Dqk]``, ``v: [B,T,H,Dv]`` -> ``o: [B,T,H,Dv]``. Three kernels, one program
per (row block, batch, head); self-attention (q and k have one length T), causal or not:

* forward: online softmax over key blocks; saves the log-sum-exp (base 2) ``lse: [B,H,Tp]`` float32;
* dK/dV: one key block per program, loops over query blocks (recomputes ``P = exp2(S - lse)``);
* dQ: one query block per program, loops over key blocks;

with ``delta = rowsum(o * do)`` computed before them in XLA (one fused reduction). Causal programs skip the
blocks above the diagonal and mask only the diagonal blocks; ``T`` need not be a multiple of a block (rows
past ``T`` are masked on load and store), and head dims are padded to a power of two by masked loads.

Packed documents (``segment_ids [B,T]``, nondecreasing): XLA turns them into each token's document ``start`` and
``end`` (first and last position, ``[B,Tp]`` int32); a query sees a key only if both have one ``start``, and a
program visits only the blocks between its rows' documents' first and last positions, so the cost falls with
the documents' length (every visited block is masked).

``impl="auto"`` picks between cuDNN, this kernel and the XLA reference: :mod:`hybrid_jax.kernels.cudnn_attention`.
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
class _Static:
    """Everything the kernels are specialised on (hashable: a ``custom_vjp`` non-differentiable argument)."""

    causal: bool
    scale: float
    config: tuning.AttentionConfig
    interpret: bool
    documents: bool = False  # start / end refs follow q, k, v (packed documents)


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, scale: float | None = None,
    config: tuning.AttentionConfig | None = None, interpret: bool = False, segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Pallas flash attention. ``q, k: [B,T,H,Dqk]``, ``v: [B,T,H,Dv]`` (one dtype) -> ``[B,T,H,Dv]``.

    ``scale`` defaults to ``Dqk**-0.5``; ``config`` to the table entry of the current GPU
    (:func:`tuning.attention_config`, tiles for bf16: float32 inputs get half-width key tiles);
    ``interpret=True`` runs the same kernels on CPU. ``segment_ids [B,T]`` int: packed documents, a query sees
    only its own document.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"attention: need q, k [B,T,H,Dqk] and v [B,T,H,Dv], got {q.shape}, {k.shape}, {v.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if config is None:
        config = tuning.attention_config(head_dim=_pow2(max(q.shape[-1], v.shape[-1])))
        if q.dtype.itemsize >= 4:  # float32 tiles take twice the shared memory
            config = _halve_block_k(config)
    if segment_ids is None:
        return _flash(q, k, v, None, _Static(causal, scale, config, interpret))
    static = _Static(causal, scale, config, interpret, documents=True)
    return _flash(q, k, v, document_bounds(segment_ids, _padded_len(static, q.shape[1])), static)


def document_bounds(segment_ids: jax.Array, padded_len: int) -> tuple[jax.Array, jax.Array]:
    """XLA: each token's document's first and last position, ``([B,Tp], [B,Tp])`` int32 (``segment_ids [B,T]``
    nondecreasing; the padding repeats the last token's)."""
    B, T = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    new = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    last = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones((B, 1), bool)], axis=1)
    start = lax.cummax(jnp.where(new, pos, 0), axis=1)
    end = lax.cummin(jnp.where(last, pos, T - 1), axis=1, reverse=True)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, padded_len - T)), mode="edge")  # noqa: E731
    return pad(start), pad(end)


def _halve_block_k(config: tuning.AttentionConfig) -> tuning.AttentionConfig:
    def halve(kc: tuning.AttentionKernel) -> tuning.AttentionKernel:
        return dataclasses.replace(kc, block_k=max(16, kc.block_k // 2))

    return tuning.AttentionConfig(fwd=halve(config.fwd), dkdv=halve(config.dkdv), dq=halve(config.dq))


def _pow2(n: int) -> int:
    """Next power of two, at least 16 (the smallest Triton dot)."""
    return max(16, pl.next_power_of_2(n))


def _blocks(kc: tuning.AttentionKernel, seq_len: int) -> tuple[int, int]:
    """A kernel's (block_q, block_k), shrunk for short sequences."""
    cap = _pow2(seq_len)
    return min(kc.block_q, cap), min(kc.block_k, cap)


def _padded_len(static: _Static, seq_len: int) -> int:
    """Length of the row-statistics arrays (lse, delta): a multiple of every block of every kernel."""
    c = static.config
    step = max(b for kc in (c.fwd, c.dkdv, c.dq) for b in _blocks(kc, seq_len))
    return pl.cdiv(seq_len, step) * step


# ---------------------------------------------------------------------------------------------- kernel pieces


def _row_col_mask(ref, start, rows: int, seq_len: int, width: int) -> jax.Array | None:
    """Mask of rows ``< seq_len`` and columns ``< width`` of a ``[rows, Dpad]`` tile; ``None`` when all are in."""
    mask = None
    if seq_len % rows:
        mask = (start + jnp.arange(rows) < seq_len)[:, None]
    if width != ref.shape[-1]:
        cols = (jnp.arange(ref.shape[-1]) < width)[None, :]
        mask = cols if mask is None else mask & cols
    return mask


def _load_rows(ref, start, rows: int, seq_len: int, width: int) -> jax.Array:
    """Rows ``[start, start+rows)`` of a ``[Tp, Dpad]`` block ref, zero past ``seq_len`` and past column ``width``."""
    mask = _row_col_mask(ref, start, rows, seq_len, width)
    if mask is None:
        return ref[pl.ds(start, rows), :]
    return pltriton.load(ref.at[pl.ds(start, rows), :], mask=mask, other=0.0)


def _store_rows(ref, start, x: jax.Array, seq_len: int, width: int) -> None:
    mask = _row_col_mask(ref, start, x.shape[0], seq_len, width)
    pltriton.store(ref.at[pl.ds(start, x.shape[0]), :], x.astype(ref.dtype), mask=mask)


def _load_stat(ref, start, rows: int, seq_len: int) -> jax.Array:
    """Row statistics (lse or delta) of rows ``[start, start+rows)``; zero past ``seq_len``."""
    if seq_len % rows == 0:
        return ref[pl.ds(start, rows)]
    return pltriton.load(ref.at[pl.ds(start, rows)], mask=start + jnp.arange(rows) < seq_len, other=0.0)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` of 2-D tiles into float32; float32 tiles multiply in full precision (not TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _scores(a: jax.Array, b: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *, scale: float, masked: bool,
            causal: bool, seq_len: int, same_doc: jax.Array | None = None) -> jax.Array:
    """``a b^T * scale * log2(e)`` in float32: ``S`` for ``(a, b) = (q, k)``, ``S^T`` for ``(k, q)``.

    ``q_pos``, ``k_pos``: query and key positions shaped to broadcast against the result (``[n,1]``, ``[1,m]``
    or transposed). Masked blocks get the causal mask and, for a ragged tail, the key-range mask; ``same_doc``
    (the result's shape, bool): also the document mask.
    """
    s = _dot(a, b.T) * (scale * LOG2E)
    if not masked:
        return s
    keep = (q_pos >= k_pos) if causal else None
    if same_doc is not None:
        keep = same_doc if keep is None else keep & same_doc
    if seq_len % k_pos.size:
        keep = k_pos < seq_len if keep is None else keep & (k_pos < seq_len)
    return s if keep is None else jnp.where(keep, s, MASKED)


def _positions(start, n: int, axis: int) -> jax.Array:
    """``start + [0, n)`` as a column (``axis=0``, ``[n,1]``) or a row (``axis=1``, ``[1,n]``)."""
    pos = start + jnp.arange(n)
    return pos[:, None] if axis == 0 else pos[None, :]


def _key_blocks(qi, bq: int, bk: int, seq_len: int, causal: bool):
    """Key blocks a query block ``qi`` sees: ``[0, n_full)`` need no mask, ``[n_full, n_all)`` do."""
    n_keys = pl.cdiv(seq_len, bk)
    if not causal:
        return seq_len // bk, n_keys
    # Keys below the block's first row are visible to all its rows (and < seq_len, as that row is).
    return lax.div(qi * bq, bk), jnp.minimum(lax.div((qi + 1) * bq + bk - 1, bk), n_keys)


def _query_blocks(kj, bq: int, bk: int, seq_len: int, causal: bool):
    """Query blocks a key block ``kj`` reaches: ``[first, n_masked)`` need the mask, ``[n_masked, n_all)`` not."""
    n_q = pl.cdiv(seq_len, bq)
    if not causal:
        return 0, 0, n_q
    return lax.div(kj * bk, bq), jnp.minimum(lax.div((kj + 1) * bk + bq - 1, bq), n_q), n_q


def _row_block(causal: bool):
    """This program's row block; causal grids run the longest (last) blocks first."""
    i = pl.program_id(0)
    return pl.num_programs(0) - 1 - i if causal else i


# ---------------------------------------------------------------------------------------------------- kernels


def _document_blocks(start_ref, end_ref, first, rows: int, block: int, n_blocks, causal_last):
    """The blocks (of ``block`` positions) that rows ``[first, first + rows)`` can see: from the one holding
    their first document's start to the one holding their last document's end (or ``causal_last``), and the
    rows' document starts ``[rows]``."""
    start = start_ref[pl.ds(first, rows)]
    lo = lax.div(jnp.min(start), block)
    hi = causal_last if causal_last is not None else jnp.minimum(
        lax.div(jnp.max(end_ref[pl.ds(first, rows)]), block) + 1, n_blocks)
    return lo, hi, start


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, static: _Static, seq_len: int, dqk: int, dv: int, bq: int, bk: int):
    *doc_refs, o_ref, lse_ref = refs  # doc_refs: start, end [Tp] int32 (packed documents)
    qi = _row_block(static.causal)
    q = _load_rows(q_ref, qi * bq, bq, seq_len, dqk)
    q_pos = _positions(qi * bq, bq, 0)
    score = functools.partial(_scores, scale=static.scale, causal=static.causal, seq_len=seq_len)
    q_start = None

    def body(kj, carry, masked: bool):
        acc, m, l = carry
        k = _load_rows(k_ref, kj * bk, bk, seq_len, dqk)
        same = None if q_start is None else q_start[:, None] == doc_refs[0][pl.ds(kj * bk, bk)][None, :]
        s = score(q, k, q_pos, _positions(kj * bk, bk, 1), masked=masked, same_doc=same)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        v = _load_rows(v_ref, kj * bk, bk, seq_len, dv)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    n_full, n_all = _key_blocks(qi, bq, bk, seq_len, static.causal)
    if doc_refs:  # every visited block masked
        n_full, n_all, q_start = _document_blocks(*doc_refs, qi * bq, bq, bk, pl.cdiv(seq_len, bk),
                                                  n_all if static.causal else None)
    else:
        carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, n_all, functools.partial(body, masked=True), carry)
    _store_rows(o_ref, qi * bq, acc / l[:, None], seq_len, dv)
    lse_ref[pl.ds(qi * bq, bq)] = m + jnp.log2(l)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, static: _Static, seq_len: int, dqk: int,
                 dv: int, bq: int, bk: int):
    *doc_refs, dk_ref, dv_ref = refs  # doc_refs: start, end [Tp] int32 (packed documents)
    kj = pl.program_id(0)
    k = _load_rows(k_ref, kj * bk, bk, seq_len, dqk)
    v = _load_rows(v_ref, kj * bk, bk, seq_len, dv)
    k_pos = _positions(kj * bk, bk, 0)
    score = functools.partial(_scores, scale=static.scale, causal=static.causal, seq_len=seq_len)
    k_start = None

    def body(qi, carry, masked: bool):  # transposed tiles: P^T, dP^T, dS^T are [bk, bq]
        dk_acc, dv_acc = carry
        q = _load_rows(q_ref, qi * bq, bq, seq_len, dqk)
        do = _load_rows(do_ref, qi * bq, bq, seq_len, dv)
        same = None if k_start is None else k_start[:, None] == doc_refs[0][pl.ds(qi * bq, bq)][None, :]
        s_t = score(k, q, _positions(qi * bq, bq, 1), k_pos, masked=masked, same_doc=same)
        p_t = jnp.exp2(s_t - _load_stat(lse_ref, qi * bq, bq, seq_len)[None, :])
        dv_acc += _dot(p_t.astype(do.dtype), do)
        ds_t = p_t * (_dot(v, do.T) - _load_stat(delta_ref, qi * bq, bq, seq_len)[None, :])
        dk_acc += _dot(ds_t.astype(q.dtype), q)
        return dk_acc, dv_acc

    carry = (jnp.zeros((bk, k_ref.shape[-1]), jnp.float32), jnp.zeros((bk, v_ref.shape[-1]), jnp.float32))
    first, n_masked, n_all = _query_blocks(kj, bq, bk, seq_len, static.causal)
    if doc_refs:  # the query blocks up to the key block's last document's end, every one masked
        lo, n_masked, k_start = _document_blocks(*doc_refs, kj * bk, bk, bq, n_all, None)
        first = first if static.causal else lo
        n_all = n_masked
    carry = lax.fori_loop(first, n_masked, functools.partial(body, masked=True), carry)
    dk_acc, dv_acc = lax.fori_loop(n_masked, n_all, functools.partial(body, masked=False), carry)
    _store_rows(dk_ref, kj * bk, dk_acc * static.scale, seq_len, dqk)
    _store_rows(dv_ref, kj * bk, dv_acc, seq_len, dv)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, static: _Static, seq_len: int,
               dqk: int, dv: int, bq: int, bk: int):
    *doc_refs, dq_ref = refs  # doc_refs: start, end [Tp] int32 (packed documents)
    qi = _row_block(static.causal)
    q = _load_rows(q_ref, qi * bq, bq, seq_len, dqk)
    do = _load_rows(do_ref, qi * bq, bq, seq_len, dv)
    lse = _load_stat(lse_ref, qi * bq, bq, seq_len)[:, None]
    delta = _load_stat(delta_ref, qi * bq, bq, seq_len)[:, None]
    q_pos = _positions(qi * bq, bq, 0)
    score = functools.partial(_scores, scale=static.scale, causal=static.causal, seq_len=seq_len)
    n_full, n_all = _key_blocks(qi, bq, bk, seq_len, static.causal)
    q_start = None
    if doc_refs:  # every visited block masked
        n_full, n_all, q_start = _document_blocks(*doc_refs, qi * bq, bq, bk, pl.cdiv(seq_len, bk),
                                                  n_all if static.causal else None)

    def body(kj, dq_acc, masked: bool):
        k = _load_rows(k_ref, kj * bk, bk, seq_len, dqk)
        v = _load_rows(v_ref, kj * bk, bk, seq_len, dv)
        same = None if q_start is None else q_start[:, None] == doc_refs[0][pl.ds(kj * bk, bk)][None, :]
        p = jnp.exp2(score(q, k, q_pos, _positions(kj * bk, bk, 1), masked=masked, same_doc=same) - lse)
        ds = p * (_dot(do, v.T) - delta)
        return dq_acc + _dot(ds.astype(k.dtype), k)

    dq_acc = jnp.zeros(q.shape, jnp.float32)
    if not doc_refs:
        dq_acc = lax.fori_loop(0, n_full, functools.partial(body, masked=False), dq_acc)
    dq_acc = lax.fori_loop(n_full, n_all, functools.partial(body, masked=True), dq_acc)
    _store_rows(dq_ref, qi * bq, dq_acc * static.scale, seq_len, dqk)


# ----------------------------------------------------------------------------------------------- pallas calls


def _call(kernel, kc: tuning.AttentionKernel, static: _Static, grid_rows: int, inputs, out_shape, name: str,
          **kernel_kw):
    """One ``pallas_call`` with grid ``(grid_rows, B, H)``: every operand is one (batch, head) slab.

    Sequence operands ``[B,T,H,D]`` get a ``[Tp, Dpad]`` block, row statistics ``[B,H,Tp]`` a ``[Tp]`` block.
    """
    B, T, H = inputs[0].shape[:3]
    Tp = _padded_len(static, T)

    def spec(shape):
        if len(shape) == 2:  # [B, Tp] document bounds
            return pl.BlockSpec((None, Tp), lambda i, b, h: (b, 0))
        if len(shape) == 3:  # [B, H, Tp] statistics
            return pl.BlockSpec((None, None, Tp), lambda i, b, h: (b, h, 0))
        return pl.BlockSpec((None, Tp, None, _pow2(shape[-1])), lambda i, b, h: (b, 0, h, 0))

    return pl.pallas_call(
        functools.partial(kernel, static=static, seq_len=T, **kernel_kw),
        grid=(grid_rows, B, H),
        in_specs=[spec(x.shape) for x in inputs],
        out_specs=[spec(s.shape) for s in out_shape],
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=kc.launch.num_warps, num_stages=kc.launch.num_stages),
        interpret=static.interpret,
        name=name,
    )(*inputs)


def _forward(q, k, v, docs, static: _Static) -> tuple[jax.Array, jax.Array]:
    """``docs``: :func:`document_bounds` or None."""
    B, T, H, dqk = q.shape
    dv = v.shape[-1]
    bq, bk = _blocks(static.config.fwd, T)
    out_shape = [jax.ShapeDtypeStruct((B, T, H, dv), v.dtype),
                 jax.ShapeDtypeStruct((B, H, _padded_len(static, T)), jnp.float32)]
    o, lse = _call(_fwd_kernel, static.config.fwd, static, pl.cdiv(T, bq), (q, k, v, *(docs or ())), out_shape,
                   "flash_attention_fwd", dqk=dqk, dv=dv, bq=bq, bk=bk)
    return o, lse


def _backward(q, k, v, docs, o, lse, do, static: _Static) -> tuple[jax.Array, jax.Array, jax.Array]:
    B, T, H, dqk = q.shape
    dv = v.shape[-1]
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, lse.shape[-1] - T)))
    inputs = (q, k, v, do, lse, delta, *(docs or ()))
    bq, bk = _blocks(static.config.dkdv, T)
    dk, dv_ = _call(_dkdv_kernel, static.config.dkdv, static, pl.cdiv(T, bk), inputs,
                    [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                    "flash_attention_dkdv", dqk=dqk, dv=dv, bq=bq, bk=bk)
    bq, bk = _blocks(static.config.dq, T)
    (dq,) = _call(_dq_kernel, static.config.dq, static, pl.cdiv(T, bq), inputs,
                  [jax.ShapeDtypeStruct(q.shape, q.dtype)], "flash_attention_dq", dqk=dqk, dv=dv, bq=bq, bk=bk)
    return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, docs, static: _Static) -> jax.Array:
    return _forward(q, k, v, docs, static)[0]


def _flash_fwd(q, k, v, docs, static: _Static):
    o, lse = _forward(q, k, v, docs, static)
    return o, (q, k, v, docs, o, lse)


def _flash_bwd(static: _Static, residuals, do):
    q, k, v, docs, o, lse = residuals
    return (*_backward(q, k, v, docs, o, lse, do, static), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
