"""Forward launches of the recurrent kernels: the WY transform, the sequential state pass and the output.

Per chunk of ``C`` tokens with chunk-local cumulative log decay ``gamma`` and start state ``h``::

    A     = strict_lower(beta_i k_i.k_j exp(gamma_i - gamma_j)),   T = (I + A)^-1      (delta rule only)
    u     = T (beta V),   w = T (beta exp(gamma) K),   v_new = u - w h                   (no delta rule: v_new = V)
    o     = (scale Q exp(gamma)) h + P v_new,   P = incl_lower(scale Q K^T exp(gamma_i - gamma_j))
    h'    = exp(gamma_last) h + (K exp(gamma_last - gamma))^T v_new

``wy`` [B, HV, N] (delta rule only), ``state`` [B, HV, NV] (sequential over chunks, the float32 state in
registers), ``output`` [B, HV, N] (or, ``RecurrentConfig.output_in_state``, inside ``state`` with ``P`` from
``wy``). Intermediates kept in HBM (u, w, T, P, v_new, snapshots) are in the input dtype, as FLA keeps them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels.recurrent import block_math as bm
from hybrid_jax.kernels.recurrent import segments as segs
from hybrid_jax.kernels.recurrent.block_math import F32
from hybrid_jax.kernels.recurrent.launch import Static, call, diagonal_launches, dims, gate_bytes, summing_gate
from hybrid_jax.kernels.tuning import fit_stages

sds = jax.ShapeDtypeStruct


def _output_gram(q: list, k: list, gamma: list, scale: float, span: float) -> list[list[jax.Array]]:
    """The output's ``P = incl_lower(scale Q K^T decay)`` over row blocks, in the input dtype."""
    return [[(x * scale).astype(q[0].dtype) for x in row]
            for row in bm.block_gram(q, k, gamma, strict=False, span=span)]


def _wy_kernel(*, k_ref,  # [C, K]
               v_ref,  # [C, V]
               gamma_ref,  # [C] or [C, K]
               beta_ref,  # [C]
               u_ref,  # [C, V] out
               w_ref,  # [C, K] out
               t_ref,  # [C, C] out: T = (I + A)^-1
               q_ref=None,  # [C, K]: with p_ref
               p_ref=None,  # [C, C] out: the output's P (RecurrentConfig.output_in_state)
               rel_ref=None,  # [C] int32: packed documents (segments.py)
               span: float, scale: float | None = None):
    """One chunk: ``T = (I + A)^-1``, ``u = T (beta V)``, ``w = T (beta exp(gamma) K)`` and, with ``p_ref``, the
    output's ``P = incl_lower(scale Q K^T decay)``, from the same gate factors as ``A``; with ``rel_ref``, masked
    to the chunk's documents (``segments``)."""
    per_key = len(gamma_ref.shape) == 2
    # Inputs are loaded where they are first used and the operations keep the order of the single-tile kernels, so at
    # chunk 16 (one block) the Triton IR is op for op the one whose launches were tuned.
    k, gamma, b = (bm.blocks(r, per_key) for r in (k_ref, gamma_ref, beta_ref))
    cd = k[0].dtype
    b = [x.astype(F32) for x in b]
    docs = segs.load(rel_ref, per_key)
    g = segs.pairs(bm.block_gram(k, k, gamma, strict=True, span=span), docs)
    a = [[x * b[i][:, None] for x in row] for i, row in enumerate(g)]
    t = [[x.astype(cd) for x in row] for row in bm.block_unit_lower_inverse(a)]  # float32, used in the input dtype
    bm.store_lower(t_ref, t)
    v = bm.blocks(v_ref, per_key)
    bm.store_blocks(u_ref, bm.lower_matmul(t, [(x.astype(F32) * bx[:, None]).astype(cd)
                                               for x, bx in zip(v, b, strict=True)]))
    bm.store_blocks(w_ref, bm.lower_matmul(t, [
        (x.astype(F32) * bx[:, None] * segs.carried(bm.per_column(jnp.exp(g)), docs, i)).astype(cd)
        for i, (x, bx, g) in enumerate(zip(k, b, gamma, strict=True))]))
    if p_ref is not None:
        bm.store_lower(p_ref, segs.pairs(_output_gram(bm.blocks(q_ref, per_key), k, gamma, scale, span), docs))


def _state_kernel(*, k_ref,  # [T, K]
                  gamma_ref,  # [T] or [T, K]
                  u_ref,  # [T, BV]: u (delta rule) or V
                  h0_ref,  # [K, BV]
                  final_ref,  # [K, BV] out, float32
                  h_ref=None,  # [N, K, BV] out: the state at each chunk's start (None: the final state only)
                  w_ref=None,  # [T, K] (delta rule)
                  v_new_ref=None,  # [T, BV] out (delta rule; None: the final state only)
                  q_ref=None,  # [T, K]: with o_ref
                  p_ref=None,  # [T, C]: with o_ref
                  o_ref=None,  # [T, BV] out (RecurrentConfig.output_in_state)
                  keep_ref=None,  # [W] int32: packed documents (segments.chunk_keeps)
                  chunk: int, n_chunks: int, scale: float | None = None, u_tiles: int | None = None):
    """Sequential over chunks for one (batch, head, V tile): h snapshots, v_new, final state (without ``h_ref``
    and ``v_new_ref``: the final state alone); ``u_tiles``: the V tiles past the first ``u_tiles`` see a zero ``u``
    (a context shard's transition columns: ``u_ref`` is then ``u``'s last tile, not read); with ``o_ref`` also
    this V tile of ``o = (scale Q exp(gamma)) h + P v_new``, from the carried float32 state (rounded as the snapshot
    is). With ``keep_ref`` (``k`` and ``q`` then masked by ``segments.sequential_qk``) the start state's decay
    follows the chunk's documents."""
    cd = k_ref.dtype
    reads_u = None if u_tiles is None else pl.program_id(2) < u_tiles

    def body(c, s, keep):
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        if h_ref is not None:
            h_ref[c] = s.astype(h_ref.dtype)
        k = k_ref[rows, :]
        gamma = gamma_ref[rows]
        gamma_last = bm.row(gamma, -1)
        if reads_u is None:
            v_new = u_ref[rows, :].astype(F32)
        else:  # a masked load: the transition's tiles fetch nothing
            v_new = pltriton.load(u_ref.at[rows, :], mask=jnp.full((chunk, u_ref.shape[-1]), reads_u),
                                  other=0.0).astype(F32)
        if w_ref is not None:
            v_new = v_new - bm.dot(w_ref[rows, :], s.astype(cd))
            if v_new_ref is not None:
                v_new_ref[rows, :] = v_new.astype(v_new_ref.dtype)
        if o_ref is not None:
            qd = (q_ref[rows, :].astype(F32) * scale * bm.per_column(jnp.exp(gamma))).astype(cd)
            o_ref[rows, :] = (bm.dot(qd, s.astype(cd)) + bm.dot(p_ref[rows, :], v_new.astype(cd))).astype(o_ref.dtype)
        k_end = (k.astype(F32) * bm.per_column(jnp.exp(gamma_last - gamma))).astype(cd)
        return segs.kept(bm.state_decay(gamma_last), keep) * s + bm.dot(k_end.T, v_new.astype(cd))

    final_ref[...] = segs.loop_over_chunks(body, n_chunks, h0_ref[...].astype(F32), keep_ref)


def _output_kernel(*, q_ref,  # [C, K]
                   k_ref,  # [C, K]
                   v_new_ref,  # [C, V]
                   gamma_ref,  # [C] or [C, K]
                   h_ref,  # [K, V]: the chunk's start state
                   o_ref,  # [C, V] out
                   p_ref=None,  # [C, C] out: P, for the reverse state pass (per-key gate, packed documents)
                   rel_ref=None,  # [C] int32: packed documents (segments.py)
                   scale: float, span: float):
    """One chunk: ``o = (scale Q exp(gamma)) h + P v_new``, ``P = incl_lower(scale Q K^T decay)``; with ``rel_ref``
    masked to the chunk's documents (``segments``)."""
    per_key = len(gamma_ref.shape) == 2
    q, gamma, k = (bm.blocks(r, per_key) for r in (q_ref, gamma_ref, k_ref))  # order of use: as in _wy_kernel
    cd = q[0].dtype
    docs = segs.load(rel_ref, per_key)
    p = segs.pairs(_output_gram(q, k, gamma, scale, span), docs)
    if p_ref is not None:
        bm.store_lower(p_ref, p)
    qd = [(x.astype(F32) * scale * segs.carried(bm.per_column(jnp.exp(g)), docs, i)).astype(cd)
          for i, (x, g) in enumerate(zip(q, gamma, strict=True))]
    qh = [bm.dot(x, h_ref[...]) for x in qd]
    bm.store_blocks(o_ref, [x + y for x, y in zip(qh, bm.lower_matmul(p, bm.blocks(v_new_ref, per_key)),
                                                  strict=True)])


def wy(static: Static, k, v, gamma, beta, q=None, rel=None, redo_far: bool = True) -> tuple[jax.Array, ...]:
    """-> ``u [B,T,HV,V]``, ``w [B,T,HV,K]``, ``T [B,T,HV,C]`` (row t of its chunk) and, with ``q``
    (``RecurrentConfig.output_in_state``), the output's ``P [B,T,HV,C]``, in the input dtype (T is computed in
    float32). ``redo_far``: see :func:`launch.diagonal_launches`. ``rel [B,T]`` int32: packed documents
    (``reference.chunk_segments``), or None."""
    d = dims(static, k, v, gamma)
    s, C = d.specs, static.chunk
    chunk_rows = (sds((d.B, d.T, d.HV, C), k.dtype), s.rows(C))
    inputs = {"k_ref": (k, s.qk(d.K)), "v_ref": (v, s.rows(d.V)), "gamma_ref": (gamma, s.gate()),
              "beta_ref": (beta, s.vec())}
    outputs = {"u_ref": (sds((d.B, d.T, d.HV, d.V), k.dtype), s.rows(d.V)),
               "w_ref": (sds((d.B, d.T, d.HV, d.K), k.dtype), s.rows(d.K)), "t_ref": chunk_rows}
    if q is not None:
        inputs["q_ref"], outputs["p_ref"] = (q, s.qk(d.K)), chunk_rows
    if rel is not None:
        inputs["rel_ref"] = (rel, s.seg())
    kernel = functools.partial(_wy_kernel, scale=static.scale if q is not None else None)
    return tuple(diagonal_launches(kernel, "wy_fwd", static.cfg.wy, static, (d.B, d.HV, d.N), inputs, outputs,
                                   gate="gamma_ref", causal=True, redo_far=redo_far,
                                   per_program=static.cfg.chunks_per_program_at(d.K, d.V)))


def state_fwd(static: Static, k, gamma, w, u, h0, q=None, p=None, rel=None, final_only: bool = False
              ) -> tuple[jax.Array, ...]:
    """-> ``h [B,N,HV,K,V]`` (state at each chunk start), ``v_new [B,T,HV,V]`` (delta rule only: ``w`` given,
    else ``u`` is V and is returned as v_new), final state ``[B,HV,K,V]`` float32 and, with ``q`` and ``P`` (from
    :func:`wy`; ``RecurrentConfig.output_in_state``), the output ``o [B,T,HV,V]`` (input dtype). ``rel``: see
    :func:`wy`; with it ``q`` and ``k`` are masked (``segments.sequential_qk``). ``final_only``: ``(final state,)``
    alone, no snapshot or ``v_new`` written (a context shard's transition: ``kernels/recurrent/context.py``; ``h0``
    may then be wider than ``u``, a whole number of V tiles: its columns past ``u``'s see a zero input)."""
    wide = h0.shape[-1] > u.shape[-1]
    d = dims(static, k, sds((*u.shape[:3], h0.shape[-1]), u.dtype) if wide else u, gamma)
    s, C = d.specs, static.chunk
    delta, with_o = w is not None, q is not None
    u_tiles = u.shape[-1] // d.BV if wide else None
    if wide and (not final_only or with_o or u_tiles * d.BV != u.shape[-1]):
        raise ValueError(f"state_fwd: u of width {u.shape[-1]} under a wider state ({h0.shape[-1]}) needs final_only "
                         f"and whole V tiles of {d.BV}")
    kernel = functools.partial(_state_kernel, chunk=C, n_chunks=d.N, scale=static.scale if with_o else None,
                               u_tiles=u_tiles)
    kernel = summing_gate(kernel, static, gamma, "gamma_ref")
    inputs = {"k_ref": (k, s.qk_seq(d.K)), "gamma_ref": (gamma, s.gate_seq())}
    if delta:
        inputs["w_ref"] = (w, s.rows_seq(d.K))
    inputs |= {"u_ref": (u, s.vtile_seq(u_tiles)), "h0_ref": (h0, s.state_seq(d.K))}
    if with_o:
        inputs |= {"q_ref": (q, s.qk_seq(d.K)), "p_ref": (p, s.rows_seq(C))}
    if rel is not None:
        keeps = segs.chunk_keeps(rel, C)
        inputs["keep_ref"] = (keeps, s.words_seq(keeps.shape[1]))
    tile = (sds((d.B, d.T, d.HV, d.V), k.dtype), s.vtile_seq())  # v_new, o: [B,T,HV,V] outputs in V tiles
    outputs = {}
    if not final_only:
        outputs["h_ref"] = (sds((d.B, d.N, d.HV, d.K, d.V), k.dtype), s.snapshots_seq(d.N, d.K))
        if delta:
            outputs["v_new_ref"] = tile
    if with_o:
        outputs["o_ref"] = tile
    outputs["final_ref"] = (sds((d.B, d.HV, d.K, d.V), F32), s.state_seq(d.K))
    # one chunk's loads (k, gate, w, u tile; q, P): a pipeline stage's shared memory
    isz = k.dtype.itemsize
    stage = C * (d.K * isz * (2 if delta else 1) + gate_bytes(gamma) + d.BV * u.dtype.itemsize
                 + ((d.K + C) * isz if with_o else 0))
    launch = fit_stages(static.cfg.state, stage, static.cfg.shared_memory)
    name = "state_fwd_final" if final_only else "state_fwd"  # a launch's name: one kernel (profiles, lowering)
    *rest, final = call(kernel, name, launch, static, (d.B, d.HV, d.V // d.BV), inputs, outputs)
    if final_only:
        return (final,)
    h, *tiles = rest
    v_new = tiles[0] if delta else u
    return (h, v_new, final, tiles[-1]) if with_o else (h, v_new, final)


def output(static: Static, q, k, v_new, gamma, h, rel=None, delta: bool = False, redo_far: bool = True
           ) -> tuple[jax.Array, jax.Array | None]:
    """-> ``o [B,T,HV,V]`` and, with a per-key gate or with packed documents and the delta rule (``delta``), ``P
    [B,T,HV,C]`` (row t of its chunk, input dtype; masked to the documents), for the reverse state pass, else None
    (the pass recomputes it). ``redo_far``: see :func:`launch.diagonal_launches`; ``rel``: see :func:`wy`."""
    d = dims(static, q, v_new, gamma)
    s, C = d.specs, static.chunk
    with_p = gamma.ndim == 4 or (rel is not None and delta)
    inputs = {"q_ref": (q, s.qk(d.K)), "k_ref": (k, s.qk(d.K)), "v_new_ref": (v_new, s.rows(d.V)),
              "gamma_ref": (gamma, s.gate()), "h_ref": (h, s.snapshot(d.K, d.V))}
    if rel is not None:
        inputs["rel_ref"] = (rel, s.seg())
    outputs = {"o_ref": (sds((d.B, d.T, d.HV, d.V), v_new.dtype), s.rows(d.V))}
    if with_p:
        outputs["p_ref"] = (sds((d.B, d.T, d.HV, C), q.dtype), s.rows(C))
    outs = diagonal_launches(functools.partial(_output_kernel, scale=static.scale), "output_fwd", static.cfg.output,
                             static, (d.B, d.HV, d.N), inputs, outputs, gate="gamma_ref", causal=True,
                             redo_far=redo_far, per_program=static.cfg.chunks_per_program_at(d.K, d.V))
    return outs[0], (outs[1] if with_p else None)
