"""The flash attention backward (:mod:`hybrid_jax.kernels.flash_attention`): the dK/dV kernel (one key block per
program, looping over the query blocks that reach it) and the dQ kernel (one query block per program, looping over
the key blocks it sees), both recomputing ``P = exp2(S - lse)`` from the forward's log-sum-exp. Queries sit at
``offset + row`` in the keys' sequence (:mod:`hybrid_jax.kernels.flash_blocks`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hybrid_jax.kernels.flash_blocks import (
    Static,
    blocks,
    document_blocks,
    dot,
    launch,
    load_rows,
    load_stat,
    optional_refs,
    positions,
    query_blocks,
    query_key_blocks,
    row_block,
    same_document,
    scores,
    shift,
    store_rows,
)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, static: Static, q_len: int, k_len: int,
                 dqk: int, dv: int, bq: int, bk: int):
    """``q_ref: [Tqp, Dqk_pad]``, ``k_ref: [Tkp, Dqk_pad]``, ``v_ref: [Tkp, Dv_pad]``, ``do_ref: [Tqp, Dv_pad]``,
    ``lse_ref, delta_ref: [Tqp]`` float32, the optional operands (:func:`optional_refs`), then ``dk_ref: [Tkp,
    Dqk_pad]``, ``dv_ref: [Tkp, Dv_pad]``."""
    *extra, dk_ref, dv_ref = refs
    offset, docs = optional_refs(static, extra)
    kj = pl.program_id(0)
    k = load_rows(k_ref, kj * bk, bk, k_len, dqk)
    v = load_rows(v_ref, kj * bk, bk, k_len, dv)
    k_pos = positions(kj * bk, bk, 0)
    score = functools.partial(scores, scale=static.scale, causal=static.causal, k_len=k_len)
    k_start = None

    def body(qi, carry, masked: bool):  # transposed tiles: P^T, dP^T, dS^T are [bk, bq]
        dk_acc, dv_acc = carry
        q = load_rows(q_ref, qi * bq, bq, q_len, dqk)
        do = load_rows(do_ref, qi * bq, bq, q_len, dv)
        same = None if k_start is None else k_start[:, None] == docs.q_start[pl.ds(qi * bq, bq)][None, :]
        s_t = score(k, q, positions(shift(qi * bq, offset), bq, 1), k_pos, masked=masked, same_doc=same)
        p_t = jnp.exp2(s_t - load_stat(lse_ref, qi * bq, bq, q_len)[None, :])
        dv_acc += dot(p_t.astype(do.dtype), do)
        ds_t = p_t * (dot(v, do.T) - load_stat(delta_ref, qi * bq, bq, q_len)[None, :])
        dk_acc += dot(ds_t.astype(q.dtype), q)
        return dk_acc, dv_acc

    carry = (jnp.zeros((bk, k_ref.shape[-1]), jnp.float32), jnp.zeros((bk, v_ref.shape[-1]), jnp.float32))
    first, n_masked, n_all = query_blocks(kj, offset, bq, bk, q_len, static.causal)
    if docs:  # the query blocks up to the key block's last document's end, every one masked
        lo, n_masked, k_start = document_blocks(docs.k_start, docs.k_end, kj * bk, bk, bq, n_all, None, offset)
        first = first if static.causal else lo
        n_all = n_masked
    carry = lax.fori_loop(first, n_masked, functools.partial(body, masked=True), carry)
    dk_acc, dv_acc = lax.fori_loop(n_masked, n_all, functools.partial(body, masked=False), carry)
    store_rows(dk_ref, kj * bk, dk_acc * static.scale, k_len, dqk)
    store_rows(dv_ref, kj * bk, dv_acc, k_len, dv)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, static: Static, q_len: int, k_len: int,
               dqk: int, dv: int, bq: int, bk: int):
    """The dK/dV kernel's operands, then ``dq_ref: [Tqp, Dqk_pad]``."""
    *extra, dq_ref = refs
    offset, docs = optional_refs(static, extra)
    qi = row_block(static.causal)
    q = load_rows(q_ref, qi * bq, bq, q_len, dqk)
    do = load_rows(do_ref, qi * bq, bq, q_len, dv)
    lse = load_stat(lse_ref, qi * bq, bq, q_len)[:, None]
    delta = load_stat(delta_ref, qi * bq, bq, q_len)[:, None]
    q_pos = positions(shift(qi * bq, offset), bq, 0)
    score = functools.partial(scores, scale=static.scale, causal=static.causal, k_len=k_len)
    n_full, n_all, q_start = query_key_blocks(static, docs, qi, offset, bq, bk, k_len)

    def body(kj, dq_acc, masked: bool):
        k = load_rows(k_ref, kj * bk, bk, k_len, dqk)
        v = load_rows(v_ref, kj * bk, bk, k_len, dv)
        same = same_document(q_start, docs, kj, bk)
        p = jnp.exp2(score(q, k, q_pos, positions(kj * bk, bk, 1), masked=masked, same_doc=same) - lse)
        ds = p * (dot(do, v.T) - delta)
        return dq_acc + dot(ds.astype(k.dtype), k)

    dq_acc = jnp.zeros(q.shape, jnp.float32)
    if not docs:
        dq_acc = lax.fori_loop(0, n_full, functools.partial(body, masked=False), dq_acc)
    dq_acc = lax.fori_loop(n_full, n_all, functools.partial(body, masked=True), dq_acc)
    store_rows(dq_ref, qi * bq, dq_acc * static.scale, q_len, dqk)


def backward(q, k, v, offset, docs, o, lse, do, static: Static) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of ``o = flash_attention(q, k, v)`` (``lse``: its ``[B,H,Tqp]`` log-sum-exp) for ``do``;
    ``offset`` and ``docs`` as the forward's."""
    Tq, dqk = q.shape[1], q.shape[-1]
    Tk, dv = k.shape[1], v.shape[-1]
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, lse.shape[-1] - Tq)))
    inputs = (q, k, v, do, lse, delta, *(() if offset is None else (offset,)), *docs)
    lengths = dict(q_len=Tq, k_len=Tk, dqk=dqk, dv=dv)
    bq, bk = blocks(static.config.dkdv, Tq, Tk)
    dk, dv_ = launch(_dkdv_kernel, static.config.dkdv, static, pl.cdiv(Tk, bk), inputs,
                     [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                     "flash_attention_dkdv", bq=bq, bk=bk, **lengths)
    bq, bk = blocks(static.config.dq, Tq, Tk)
    (dq,) = launch(_dq_kernel, static.config.dq, static, pl.cdiv(Tq, bq), inputs,
                   [jax.ShapeDtypeStruct(q.shape, q.dtype)], "flash_attention_dq", bq=bq, bk=bk, **lengths)
    return dq, dk, dv_
