"""Flash attention in Pallas (Triton lowering), forward and backward; qk head dim may differ from v's.

Shapes follow FLA: ``q: [B,Tq,H,Dqk]``, ``k: [B,Tk,H,Dqk]``, ``v: [B,Tk,H,Dv]`` -> ``o: [B,Tq,H,Dv]``. The queries
are the tokens at positions ``q_offset .. q_offset + Tq - 1`` of the keys' sequence: self-attention (``Tq == Tk``,
offset 0), or a context shard's queries over the whole sequence's keys (the offset a traced scalar). Three kernels,
one program per (row block, batch, head), causal or not (pieces: :mod:`hybrid_jax.kernels.flash_blocks`):

* forward (here): online softmax over key blocks; saves the log-sum-exp (base 2) ``lse: [B,H,Tqp]`` float32;
* dK/dV (:mod:`hybrid_jax.kernels.flash_attention_bwd`): one key block per program, loops over query blocks
  (recomputes ``P = exp2(S - lse)``);
* dQ (same file): one query block per program, loops over key blocks;

with ``delta = rowsum(o * do)`` computed before them in XLA (one fused reduction). Causal programs skip the
blocks above the diagonal (taken at the queries' offset) and mask only the blocks it crosses; ``Tq``, ``Tk`` need not
be multiples of a block (rows past them are masked on load and store), and head dims are padded to a power of two
by masked loads.

Packed documents (``segment_ids [B,Tk]``, nondecreasing, the keys' sequence): XLA turns them into each token's
document ``start`` and ``end`` (first and last position, ``[B,Tkp]`` int32; the queries' rows are a slice of them); a
query sees a key only if both have one ``start``, and a program visits only the blocks between its rows' documents'
first and last positions, so the cost falls with the documents' length (every visited block is masked).

``impl="auto"`` picks between cuDNN, this kernel and the XLA reference: :mod:`hybrid_jax.kernels.cudnn_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hybrid_jax.kernels import flash_attention_bwd, tuning
from hybrid_jax.kernels.flash_blocks import (
    MASKED,
    Static,
    blocks,
    dot,
    has_offset,
    launch,
    load_rows,
    optional_refs,
    padded_len,
    positions,
    pow2,
    query_key_blocks,
    row_block,
    same_document,
    scores,
    shift,
    store_rows,
)


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, scale: float | None = None,
    config: tuning.AttentionConfig | None = None, interpret: bool = False, segment_ids: jax.Array | None = None,
    q_offset: int | jax.Array | None = None,
) -> jax.Array:
    """Pallas flash attention. ``q: [B,Tq,H,Dqk]``, ``k: [B,Tk,H,Dqk]``, ``v: [B,Tk,H,Dv]`` (one dtype) ->
    ``[B,Tq,H,Dv]``.

    ``scale`` defaults to ``Dqk**-0.5``; ``config`` to the table entry of the current GPU
    (:func:`tuning.attention_config`, tiles for bf16: float32 inputs get half-width key tiles);
    ``interpret=True`` runs the same kernels on CPU. ``q_offset``: the position of the first query in the keys'
    sequence, an int or a traced int scalar with ``0 <= q_offset <= Tk - Tq`` (checked only when static); ``None``:
    ``Tk - Tq`` (self-attention: 0). ``segment_ids [B,Tk]`` int: the keys' sequence's packed documents (the queries'
    are its rows from ``q_offset``); a query sees only its own document.
    """
    same = q.ndim == k.ndim == v.ndim == 4 and k.shape[:1] + k.shape[2:] == q.shape[:1] + q.shape[2:]
    if not same or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: need q [B,Tq,H,Dqk], k [B,Tk,H,Dqk] and v [B,Tk,H,Dv], got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    Tq, Tk = q.shape[1], k.shape[1]
    if Tq > Tk or (isinstance(q_offset, int) and not 0 <= q_offset <= Tk - Tq):
        raise ValueError(f"attention: {Tq} queries at offset {q_offset} do not lie within {Tk} keys")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if config is None:
        config = tuning.attention_config(head_dim=pow2(max(q.shape[-1], v.shape[-1])))
        if q.dtype.itemsize >= 4:  # float32 tiles take twice the shared memory
            config = _halve_block_k(config)
    offset = None
    if has_offset(q_offset, Tq, Tk):
        offset = jnp.asarray(Tk - Tq if q_offset is None else q_offset, jnp.int32)
    static = Static(causal, scale, config, interpret, documents=segment_ids is not None, offset=offset is not None)
    docs = ()
    if segment_ids is not None:
        start, end = document_bounds(segment_ids, padded_len(static, Tk, Tq, Tk))
        docs = (start, end)
        if offset is not None:
            Tqp = padded_len(static, Tq, Tq, Tk)
            docs = (_query_rows(start, offset, Tq, Tqp), _query_rows(end, offset, Tq, Tqp), start, end)
    return _flash(q, k, v, offset, docs, static)


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


def _query_rows(bound: jax.Array, offset: jax.Array, q_len: int, padded_len: int) -> jax.Array:
    """The queries' rows ``[offset, offset + q_len)`` of the keys' bounds ``[B,Tkp]`` -> ``[B,Tqp]`` (edge-padded)."""
    rows = lax.dynamic_slice_in_dim(bound, offset, q_len, axis=1)
    return jnp.pad(rows, ((0, 0), (0, padded_len - q_len)), mode="edge")


def _halve_block_k(config: tuning.AttentionConfig) -> tuning.AttentionConfig:
    def halve(kc: tuning.AttentionKernel) -> tuning.AttentionKernel:
        return dataclasses.replace(kc, block_k=max(16, kc.block_k // 2))

    return tuning.AttentionConfig(fwd=halve(config.fwd), dkdv=halve(config.dkdv), dq=halve(config.dq))


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, static: Static, q_len: int, k_len: int, dqk: int, dv: int, bq: int,
                bk: int):
    """``q_ref: [Tqp, Dqk_pad]``, ``k_ref: [Tkp, Dqk_pad]``, ``v_ref: [Tkp, Dv_pad]``, then ``refs``: the optional
    operands (:func:`optional_refs`), ``o_ref: [Tqp, Dv_pad]``, ``lse_ref: [Tqp]`` float32."""
    *extra, o_ref, lse_ref = refs
    offset, docs = optional_refs(static, extra)
    qi = row_block(static.causal)
    q = load_rows(q_ref, qi * bq, bq, q_len, dqk)
    q_pos = positions(shift(qi * bq, offset), bq, 0)
    score = functools.partial(scores, scale=static.scale, causal=static.causal, k_len=k_len)
    n_full, n_all, q_start = query_key_blocks(static, docs, qi, offset, bq, bk, k_len)

    def body(kj, carry, masked: bool):
        acc, m, l = carry
        k = load_rows(k_ref, kj * bk, bk, k_len, dqk)
        same = same_document(q_start, docs, kj, bk)
        s = score(q, k, q_pos, positions(kj * bk, bk, 1), masked=masked, same_doc=same)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        v = load_rows(v_ref, kj * bk, bk, k_len, dv)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    if not docs:  # with documents every visited block is masked
        carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, n_all, functools.partial(body, masked=True), carry)
    store_rows(o_ref, qi * bq, acc / l[:, None], q_len, dv)
    lse_ref[pl.ds(qi * bq, bq)] = m + jnp.log2(l)


def _forward(q, k, v, offset, docs, static: Static) -> tuple[jax.Array, jax.Array]:
    """``offset``: an int32 scalar or None; ``docs``: the document bounds (:func:`optional_refs`' order) or ()."""
    B, Tq, H, dqk = q.shape
    Tk, dv = k.shape[1], v.shape[-1]
    bq, bk = blocks(static.config.fwd, Tq, Tk)
    out_shape = [jax.ShapeDtypeStruct((B, Tq, H, dv), v.dtype),
                 jax.ShapeDtypeStruct((B, H, padded_len(static, Tq, Tq, Tk)), jnp.float32)]
    extra = (() if offset is None else (offset,)) + tuple(docs)
    o, lse = launch(_fwd_kernel, static.config.fwd, static, pl.cdiv(Tq, bq), (q, k, v, *extra), out_shape,
                    "flash_attention_fwd", q_len=Tq, k_len=Tk, dqk=dqk, dv=dv, bq=bq, bk=bk)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, offset, docs, static: Static) -> jax.Array:
    return _forward(q, k, v, offset, docs, static)[0]


def _flash_fwd(q, k, v, offset, docs, static: Static):
    o, lse = _forward(q, k, v, offset, docs, static)
    return o, (q, k, v, offset, docs, o, lse)


def _flash_bwd(static: Static, residuals, do):
    q, k, v, offset, docs, o, lse = residuals
    return (*flash_attention_bwd.backward(q, k, v, offset, docs, o, lse, do, static), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
