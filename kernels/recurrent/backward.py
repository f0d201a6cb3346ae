"""Backward launches of the recurrent kernels: the reverse state pass and the gradient pass.

``state_bwd`` [B, HV, NV]: reverse sequential over chunks, the float32 state gradient in registers: dh snapshots,
d(v_new), d(initial state). ``grad`` [B, HV, N]: dq, dk, dv, dbeta, d(gamma) per chunk, the WY backward fused in or,
where ``RecurrentConfig.splits_grad`` (large K V: the fused kernel spills), split in two launches ``grad_bwd`` (through
the output and state update) and ``grad_wy_bwd`` (through the WY transform). Without the delta rule and with a scalar
gate (Mamba2's SSD) ``grad`` is ``[B, H, N]``: each program sums dq, dk over its q/k head's value heads. The gradients
the caller gets (dq, dk, also per value head; dv) are stored in the inputs' dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hybrid_jax.kernels.recurrent import block_math as bm
from hybrid_jax.kernels.recurrent import segments as segs
from hybrid_jax.kernels.recurrent.backward_math import Snapshots, grad_through_output, grad_through_wy
from hybrid_jax.kernels.recurrent.block_math import F32
from hybrid_jax.kernels.recurrent.launch import (
    Specs,
    Static,
    call,
    diagonal_launches,
    dims,
    gate_bytes,
    over_value_heads,
    summing_gate,
    summing_over_value_heads,
)
from hybrid_jax.kernels.tuning import fit_stages

sds = jax.ShapeDtypeStruct


class Residuals(NamedTuple):
    """What the backward keeps of the forward, padded, in the input dtype: ``q, k [B,T,H,K]`` as the kernels take
    them, ``v [B,T,HV,V]``, the kernels' gate ``gamma`` (float32, ``[B,T,HV]`` or ``[B,T,HV,K]``), ``beta [B,T,HV]``
    (None: no delta rule), ``w [B,T,HV,K]`` and ``t [B,T,HV,C]`` (``T``, row t of its chunk; None without the delta
    rule), the snapshots ``h [B,N,HV,K,V]``, ``v_new [B,T,HV,V]`` and ``p [B,T,HV,C]`` (None where the reverse pass
    recomputes it: a scalar gate with the output launch and, with documents, no delta rule); ``rel [B,T]`` int32,
    packed documents (``reference.chunk_segments``), or None; ``q_seq, k_seq``: ``q`` and ``k`` as the sequential
    state passes take them (:func:`segments.sequential_qk`: masked with documents, else ``q`` and ``k``
    themselves; the reverse pass takes ``q``, ``k`` where it recomputes ``P`` with documents)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    gamma: jax.Array
    beta: jax.Array | None
    w: jax.Array | None
    t: jax.Array | None
    h: jax.Array
    v_new: jax.Array
    p: jax.Array | None
    rel: jax.Array | None
    q_seq: jax.Array
    k_seq: jax.Array


def _state_bwd_kernel(*, q_ref,  # [T, K]
                      k_ref,  # [T, K]
                      gamma_ref,  # [T] or [T, K]
                      do_ref,  # [T, BV]
                      dfinal_ref,  # [K, BV]: the gradient of the final state
                      dh0_ref,  # [K, BV] out, float32: the gradient of the initial state
                      dh_ref=None,  # [N, K, BV] out: the gradient of each chunk's end state (None: dh0 only)
                      dv_new_ref=None,  # [T, BV] out, float32; without the delta rule v's dtype (None: dh0 only)
                      w_ref=None,  # [T, K] (delta rule)
                      p_ref=None,  # [T, C]: P from the forward, else recomputed (scalar gate only)
                      h_ref=None,  # [N, K, BV]: the forward's snapshots, with hdh_ref
                      hdh_ref=None,  # [N, K] out, float32: sum_v h dh per chunk (this V tile's part)
                      keep_ref=None,  # [W] int32: packed documents (segments.chunk_keeps)
                      rel_ref=None,  # [T] int32: packed documents, P recomputed (no delta rule; q, k unmasked)
                      chunk: int, n_chunks: int, scale: float):
    """Reverse sequential pass for one (batch, head, V tile). Per chunk (last to first), with ``ds`` the gradient of
    the state at the chunk's end (without ``dh_ref`` and ``dv_new_ref``: ``dh0`` alone)::

        d(v_new) = P^T dO + K_end ds;   ds <- exp(gamma_last) ds + (scale Q exp(gamma))^T dO - w^T d(v_new)

    With ``hdh_ref`` also ``sum_v h ds``, ``h`` the state at the chunk's start: the gradient pass's
    ``d(gamma_last)`` term of the state decay. With ``keep_ref`` the start state's decay follows the chunk's
    documents; ``q`` and ``k`` are then masked by ``segments.sequential_qk`` and ``P`` given, masked, or (no delta
    rule) ``rel_ref`` given: the pass masks ``q``, ``k`` (their rows' factors) and the recomputed ``P``. ``w`` is
    not masked per row, so the first form is the delta rule's; without it the second saves the output launch
    writing ``P`` and this pass reading it, for a ``[C]`` load per chunk that is not on the ``ds`` chain."""
    cd = q_ref.dtype
    i, j = bm.iota(chunk)

    def body(step, ds, keep):
        c = n_chunks - 1 - step
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        if dh_ref is not None:
            dh_ref[c] = ds.astype(dh_ref.dtype)
        if hdh_ref is not None:
            hdh_ref[pl.ds(c, 1), :] = jnp.sum(h_ref[c].astype(F32) * ds, axis=1)[None, :]
        q = q_ref[rows, :]
        k = k_ref[rows, :]
        gamma = gamma_ref[rows]
        gamma_last = bm.row(gamma, -1)
        do = do_ref[rows, :]
        end_factor, start_factor = jnp.exp(gamma_last - gamma), jnp.exp(gamma)
        if p_ref is None:
            p_t = bm.dot(k, q.T) * bm.masked_exp(gamma[None, :] - gamma[:, None], i <= j) * scale
            if rel_ref is not None:  # a scalar gate ([C]): q, k masked as segments.sequential_qk, on their factors
                rel = rel_ref[rows]
                p_t = jnp.where(rel[:, None] == rel[None, :], p_t, 0.0)
                end_factor = jnp.where(rel == jnp.max(rel), end_factor, 0.0)
                start_factor = jnp.where(rel == 0, start_factor, 0.0)
            p_t = p_t.astype(cd)
        else:
            p_t = p_ref[rows, :].T
        k_end = (k.astype(F32) * bm.per_column(end_factor)).astype(cd)
        dv_new = bm.dot(p_t, do) + bm.dot(k_end, ds.astype(cd))
        if dv_new_ref is not None:
            dv_new_ref[rows, :] = dv_new.astype(dv_new_ref.dtype)
        qd = (q.astype(F32) * scale * bm.per_column(start_factor)).astype(cd)
        ds = segs.kept(bm.state_decay(gamma_last), keep) * ds + bm.dot(qd.T, do)
        if w_ref is not None:
            ds = ds - bm.dot(w_ref[rows, :].T, dv_new.astype(cd))
        return ds

    dh0_ref[...] = segs.loop_over_chunks(body, n_chunks, dfinal_ref[...].astype(F32), keep_ref, reverse=True)


def _grad_kernel(*, q_ref,  # [C, K]
                 k_ref,  # [C, K]
                 gamma_ref,  # [C] or [C, K]
                 h_ref,  # [K, V]: the chunk's start state
                 dh_ref,  # [K, V]: the gradient of its end state
                 v_new_ref,  # [C, V]
                 do_ref,  # [C, V]
                 dq_ref,  # [C, K] out, float32
                 dk_ref,  # [C, K] out, float32
                 dgamma_ref,  # [C] or [C, K] out, float32
                 hdh_ref=None,  # [K]: sum_v h dh from the reverse state pass
                 v_ref=None,  # [C, V]; this and the rest: the WY part fused in (delta rule)
                 beta_ref=None,  # [C]
                 t_ref=None,  # [C, C]
                 dv_new_ref=None,  # [C, V]
                 dv_ref=None,  # [C, V] out, float32
                 dbeta_ref=None,  # [C] out, float32
                 rel_ref=None,  # [C] int32: packed documents (segments.py)
                 scale: float, span: float):
    """One chunk: dq, dk, d(gamma) and, with the WY refs, also dv and dbeta (the WY part fused in)."""
    per_key = len(gamma_ref.shape) == 2
    docs = segs.load(rel_ref, per_key)
    k, gamma, v_new, do = (bm.blocks(r, per_key) for r in (k_ref, gamma_ref, v_new_ref, do_ref))
    dv_new = bm.blocks(dv_new_ref, per_key) if dv_new_ref is not None else None
    snap = Snapshots(h_ref, dh_ref, hdh_ref)
    dq, dk, dgamma = grad_through_output(bm.blocks(q_ref, per_key), k, gamma, snap, v_new, do, scale, span, docs)
    if dv_new is not None:
        dk_wy, dgamma_wy, dv, dbeta = grad_through_wy(
            k, *(bm.blocks(r, per_key) for r in (v_ref, beta_ref)), gamma, v_new, bm.load_lower(t_ref, per_key), snap,
            dv_new, span, docs)
        bm.store_blocks(dv_ref, dv)
        bm.store_blocks(dbeta_ref, dbeta)
        dk = [x + y for x, y in zip(dk, dk_wy, strict=True)]
        dgamma = [x + y for x, y in zip(dgamma, dgamma_wy, strict=True)]
    bm.store_blocks(dq_ref, dq)
    bm.store_blocks(dk_ref, dk)
    bm.store_blocks(dgamma_ref, dgamma)


def _grad_wy_kernel(*, k_ref,  # [C, K]
                    v_ref,  # [C, V]
                    beta_ref,  # [C]
                    gamma_ref,  # [C] or [C, K]
                    v_new_ref,  # [C, V]
                    t_ref,  # [C, C]
                    h_ref,  # [K, V]
                    dv_new_ref,  # [C, V]
                    dk_in_ref,  # [C, K]: the first launch's dk
                    dgamma_in_ref,  # [C] or [C, K]: the first launch's d(gamma)
                    dk_ref,  # [C, K] out, float32
                    dgamma_ref,  # [C] or [C, K] out, float32
                    dv_ref,  # [C, V] out, float32
                    dbeta_ref,  # [C] out, float32
                    rel_ref=None,  # [C] int32: packed documents (segments.py)
                    span: float):
    """One chunk, the WY part alone (the split gradient pass's second launch): dk and d(gamma), added to the first
    launch's, dv and dbeta."""
    per_key = len(gamma_ref.shape) == 2
    k, v, beta, gamma, v_new, dv_new = (bm.blocks(r, per_key)
                                        for r in (k_ref, v_ref, beta_ref, gamma_ref, v_new_ref, dv_new_ref))
    dk, dgamma, dv, dbeta = grad_through_wy(k, v, beta, gamma, v_new, bm.load_lower(t_ref, per_key), Snapshots(h_ref),
                                            dv_new, span, segs.load(rel_ref, per_key))
    bm.store_blocks(dk_ref, [x + y for x, y in zip(dk, bm.blocks(dk_in_ref, per_key), strict=True)])
    bm.store_blocks(dgamma_ref, [x + y for x, y in zip(dgamma, bm.blocks(dgamma_in_ref, per_key), strict=True)])
    bm.store_blocks(dv_ref, dv)
    bm.store_blocks(dbeta_ref, dbeta)


def state_bwd(static: Static, res: Residuals, do: jax.Array, dfinal: jax.Array, start_only: bool = False) -> tuple:
    """-> ``dh [B,N,HV,K,V]`` (gradient of each chunk's end state), ``d(v_new) [B,T,HV,V]`` (float32 with the delta
    rule, which the gradient pass reads; else ``dv`` itself, in v's dtype), d(initial state) ``[B,HV,K,V]`` float32
    and, where ``RecurrentConfig.hdh_in_state_bwd``, ``hdh [B,N,HV,K]`` float32 (``sum_v h dh`` per chunk, from the
    float32 ``dh``), else None. ``start_only``: d(initial state) alone, nothing else written (a context shard's own
    start-state gradient: ``kernels/recurrent/context.py``)."""
    delta = res.w is not None
    d = dims(static, res.q, do, res.gamma, static.cfg.state_bwd_block_v(delta))
    s, C = d.specs, static.chunk
    hdh = static.cfg.hdh_in_state_bwd(d.K, d.V) and not start_only
    kernel = functools.partial(_state_bwd_kernel, chunk=C, n_chunks=d.N, scale=static.scale)
    kernel = summing_gate(kernel, static, res.gamma, "gamma_ref")
    masks = res.rel is not None and res.p is None  # the kernel masks q, k and the recomputed P itself
    if masks and (delta or res.gamma.ndim == 4):
        raise ValueError("state_bwd with packed documents and the delta rule or a per-key gate takes the forward's "
                         "masked P")
    q, k = (res.q, res.k) if masks else (res.q_seq, res.k_seq)
    inputs = {"q_ref": (q, s.qk_seq(d.K)), "k_ref": (k, s.qk_seq(d.K)),
              "gamma_ref": (res.gamma, s.gate_seq())}
    if delta:
        inputs["w_ref"] = (res.w, s.rows_seq(d.K))
    if res.p is not None:
        inputs["p_ref"] = (res.p, s.rows_seq(C))
    inputs |= {"do_ref": (do, s.vtile_seq()), "dfinal_ref": (dfinal, s.state_seq(d.K))}
    if hdh:
        inputs["h_ref"] = (res.h, s.snapshots_seq(d.N, d.K))
    if res.rel is not None:
        keeps = segs.chunk_keeps(res.rel, C)
        inputs["keep_ref"] = (keeps, s.words_seq(keeps.shape[1]))
    if masks:
        inputs["rel_ref"] = (res.rel, s.tokens_seq())
    outputs = {} if start_only else {
        "dh_ref": (sds((d.B, d.N, d.HV, d.K, d.V), res.q.dtype), s.snapshots_seq(d.N, d.K)),
        "dv_new_ref": (sds((d.B, d.T, d.HV, d.V), F32 if delta else res.v.dtype), s.vtile_seq())}
    outputs["dh0_ref"] = (sds((d.B, d.HV, d.K, d.V), F32), s.state_seq(d.K))
    if hdh:
        outputs["hdh_ref"] = (sds((d.B, d.N, d.HV, d.V // d.BV, d.K), F32), s.keys_per_vtile_seq(d.N, d.K))
    # one chunk's loads (q, k, gate, w, P, dO tile, rel): a pipeline stage's shared memory (the snapshot tile read for
    # hdh is not staged: offline at the KDA anchor the launch's shared memory did not change)
    isz = res.q.dtype.itemsize
    stage = C * (d.K * isz * (3 if delta else 2) + gate_bytes(res.gamma) + (C * isz if res.p is not None else 0)
                 + d.BV * do.dtype.itemsize + (4 if masks else 0))
    launch = fit_stages(static.cfg.state_bwd, stage, static.cfg.shared_memory)
    name = "state_bwd_start" if start_only else "state_bwd"  # a launch's name: one kernel (profiles, lowering)
    outs = call(kernel, name, launch, static, (d.B, d.HV, d.V // d.BV), inputs, outputs)
    if start_only:
        return (outs[0],)
    return (*outs[:3], jnp.sum(outs[3], axis=3) if hdh else None)


def grad(static: Static, res: Residuals, dh: jax.Array, hdh: jax.Array | None, dv_new: jax.Array | None,
         do: jax.Array, redo_far: bool = True) -> tuple:
    """-> ``dq, dk``, ``d(gamma)`` (the gate's shape, float32) and, with the delta rule, ``dv [B,T,HV,V]`` in v's dtype
    and ``dbeta [B,T,HV]`` float32. ``dq, dk`` in q's dtype: per q/k head ``[B,T,H,K]`` where they are final (summed
    over the value heads without the delta rule and with a scalar gate: :func:`_grad_per_key_head`; or a q/k head
    per value head), else per value head ``[B,T,HV,K]`` for the caller to sum (as FLA does). ``dh``, ``hdh`` (or
    None: computed from the snapshots), ``dv_new``: from :func:`state_bwd`. ``redo_far``: see
    :func:`launch.diagonal_launches`."""
    if res.beta is None and res.gamma.ndim == 3:
        return _grad_per_key_head(static, res, dh, hdh, do, redo_far)
    d = dims(static, res.q, res.v, res.gamma)
    s, C, cfg = d.specs, static.chunk, static.cfg
    delta = res.beta is not None
    split = delta and cfg.splits_grad(d.K, d.V)
    grid = (d.B, d.HV, d.N)
    run = functools.partial(diagonal_launches, static=static, grid=grid, causal=False, redo_far=redo_far,
                            per_program=cfg.chunks_per_program_at(d.K, d.V))
    qk_rows = (sds((d.B, d.T, d.HV, d.K), res.q.dtype), s.rows(d.K))  # per value head: the caller sums them
    dk_between = (sds((d.B, d.T, d.HV, d.K), F32), s.rows(d.K))  # the split pass's dk, added to by its WY launch
    grads = {"dq_ref": qk_rows, "dk_ref": dk_between if split else qk_rows,
             "dgamma_ref": (sds(res.gamma.shape, F32), s.gate())}
    wy_grads = {"dv_ref": (sds((d.B, d.T, d.HV, d.V), res.v.dtype), s.rows(d.V)),
                "dbeta_ref": (sds((d.B, d.T, d.HV), F32), s.vec())}
    hdh_in = {} if hdh is None else {"hdh_ref": (hdh, s.chunk_keys(d.K))}
    rel_in = {} if res.rel is None else {"rel_ref": (res.rel, s.seg())}
    kernel = functools.partial(_grad_kernel, scale=static.scale)
    if not delta or split:
        inputs = {"q_ref": (res.q, s.qk(d.K)), "k_ref": (res.k, s.qk(d.K)), "gamma_ref": (res.gamma, s.gate()),
                  "h_ref": (res.h, s.snapshot(d.K, d.V)), "dh_ref": (dh, s.snapshot(d.K, d.V)),
                  "v_new_ref": (res.v_new, s.rows(d.V)), "do_ref": (do, s.rows(d.V))} | hdh_in | rel_in
        dq, dk, dgamma = run(kernel, "grad_bwd", cfg.grad, inputs=inputs, outputs=grads, gate="gamma_ref",
                             dgate=None if delta else "dgamma_ref")
        if not delta:  # a per-key gate
            return dq, dk, dgamma
        inputs = {"k_ref": (res.k, s.qk(d.K)), "v_ref": (res.v, s.rows(d.V)), "beta_ref": (res.beta, s.vec()),
                  "gamma_ref": (res.gamma, s.gate()), "v_new_ref": (res.v_new, s.rows(d.V)),
                  "t_ref": (res.t, s.rows(C)), "h_ref": (res.h, s.snapshot(d.K, d.V)),
                  "dv_new_ref": (dv_new, s.rows(d.V)), "dk_in_ref": (dk, s.rows(d.K)),
                  "dgamma_in_ref": (dgamma, s.gate())} | rel_in
        outputs = {"dk_ref": qk_rows, "dgamma_ref": grads["dgamma_ref"]} | wy_grads
        dk, dgamma, dv, dbeta = run(_grad_wy_kernel, "grad_wy_bwd", cfg.grad_wy, inputs=inputs, outputs=outputs,
                                    gate="gamma_ref", dgate="dgamma_ref")
        return dq, dk, dgamma, dv, dbeta
    inputs = {"q_ref": (res.q, s.qk(d.K)), "k_ref": (res.k, s.qk(d.K)), "v_ref": (res.v, s.rows(d.V)),
              "beta_ref": (res.beta, s.vec()), "gamma_ref": (res.gamma, s.gate()), "t_ref": (res.t, s.rows(C)),
              "h_ref": (res.h, s.snapshot(d.K, d.V)), "dh_ref": (dh, s.snapshot(d.K, d.V)),
              "v_new_ref": (res.v_new, s.rows(d.V)), "dv_new_ref": (dv_new, s.rows(d.V)),
              "do_ref": (do, s.rows(d.V))} | hdh_in | rel_in
    return tuple(run(kernel, "grad_bwd", cfg.grad, inputs=inputs, outputs=grads | wy_grads, gate="gamma_ref",
                     dgate="dgamma_ref"))


def _grad_per_key_head(static: Static, res: Residuals, dh: jax.Array, hdh: jax.Array | None, do: jax.Array,
                       redo_far: bool) -> tuple:
    """:func:`grad` without the delta rule, scalar gate: ``(dq, dk [B,T,H,K]`` in q's dtype, ``d(gamma) [B,T,HV]``
    float32). One program per (batch, q/k head, chunk) runs the chunk's gradient for each of the head's value heads
    in turn and sums its dq, dk over them in registers (``launch.summing_over_value_heads``): it writes one q/k
    head's gradients instead of every value head's in float32 for XLA to sum."""
    d = dims(static, res.q, res.v, res.gamma)
    H, G = res.q.shape[2], d.HV // res.q.shape[2]
    s, per_key_head = d.specs, Specs(d.T, static.chunk, 1, d.BV, None)  # on the grid [B, H, N], q/k head h
    spans = {"gamma_ref": (res.gamma, s.gate()), "h_ref": (res.h, s.snapshot(d.K, d.V)),
             "dh_ref": (dh, s.snapshot(d.K, d.V)), "v_new_ref": (res.v_new, s.rows(d.V)), "do_ref": (do, s.rows(d.V))}
    if hdh is not None:
        spans["hdh_ref"] = (hdh, s.chunk_keys(d.K))
    dgamma = {"dgamma_ref": (sds(res.gamma.shape, F32), s.gate())}
    wide = {name: (x, *over_value_heads(spec, G)) for name, (x, spec) in (spans | dgamma).items()}
    key_rows = (sds((d.B, d.T, H, d.K), res.q.dtype), per_key_head.qk(d.K))
    inputs = {"q_ref": (res.q, per_key_head.qk(d.K)), "k_ref": (res.k, per_key_head.qk(d.K))}
    inputs |= {name: wide[name][:2] for name in spans}
    if res.rel is not None:
        inputs["rel_ref"] = (res.rel, s.seg())
    outputs = {"dq_ref": key_rows, "dk_ref": key_rows, "dgamma_ref": wide["dgamma_ref"][:2]}
    kernel = summing_over_value_heads(functools.partial(_grad_kernel, scale=static.scale), G,
                                      {name: axis for name, (_, _, axis) in wide.items()}, ("dq_ref", "dk_ref"))
    return tuple(diagonal_launches(kernel, "grad_bwd", static.cfg.grad, static, (d.B, H, d.N), inputs, outputs,
                                   gate="gamma_ref", causal=False, redo_far=redo_far, dgate="dgamma_ref",
                                   per_program=static.cfg.chunks_per_program_at(d.K, d.V)))
