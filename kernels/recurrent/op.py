"""The chunked recurrence as one differentiable op: XLA glue around the Pallas launches, under ``jax.custom_vjp``.

XLA does the cheap elementwise work: padding (T to a multiple of the chunk, K and V to powers of two >= 16), the
optional L2 norm of q and k, the chunk-local gate cumsum (its VJP is the reverse cumsum; or the kernels sum the gate:
``RecurrentConfig.sums_gate``), the far-chunk flags of the levels launches, and, with the delta rule or a per-key
gate, the sum of q/k gradients over grouped value heads (otherwise the gradient kernel sums them). Launches:
forward ``wy`` -> ``state_fwd`` -> ``output``; backward ``state_bwd`` -> ``grad``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hybrid_jax.kernels import reference
from hybrid_jax.kernels.l2_norm import l2_norm
from hybrid_jax.kernels.recurrent.backward import Residuals, grad, state_bwd
from hybrid_jax.kernels.recurrent.block_math import F32, SUB
from hybrid_jax.kernels.recurrent.forward import output, state_fwd, wy
from hybrid_jax.kernels.recurrent.launch import Static
from hybrid_jax.kernels.recurrent.segments import sequential_qk
from hybrid_jax.kernels.tuning import RecurrentConfig, recurrent_config, recurrent_op


class WY(NamedTuple):
    """The forward's first stage: ``u, w [B,T,HV,*]``, ``t`` (``T``) and ``p`` (the output's ``P`` where the state
    pass writes the output, else None) from :func:`forward.wy`, ``q_seq, k_seq`` (``segments.sequential_qk``)."""

    u: jax.Array
    w: jax.Array | None
    t: jax.Array | None
    p: jax.Array | None
    q_seq: jax.Array
    k_seq: jax.Array


def wy_stage(static: Static, q, k, v, gamma, beta, rel) -> WY:
    """The WY transform (the delta rule; ``beta=None``: ``u = v``), and ``q``, ``k`` as the state passes take them."""
    q_seq, k_seq = sequential_qk(q, k, rel, static.chunk)
    if beta is None:
        return WY(v, None, None, None, q_seq, k_seq)
    if static.cfg.output_in_state_at(k.shape[-1], v.shape[-1]):
        return WY(*wy(static, k, v, gamma, beta, q, rel=rel), q_seq, k_seq)
    return WY(*wy(static, k, v, gamma, beta, rel=rel), None, q_seq, k_seq)


def from_start(static: Static, q, k, v, gamma, beta, h0, rel, s: WY) -> tuple[jax.Array, jax.Array, Residuals]:
    """The forward after :func:`wy_stage`, from the start state ``h0`` -> ``(o, final state, residuals)``."""
    if s.p is not None:
        h, v_new, final, o = state_fwd(static, s.k_seq, gamma, s.w, s.u, h0, s.q_seq, s.p, rel=rel)
        return o, final, Residuals(q, k, v, gamma, beta, s.w, s.t, h, v_new, s.p, rel, s.q_seq, s.k_seq)
    h, v_new, final = state_fwd(static, s.k_seq, gamma, s.w, s.u, h0, rel=rel)
    o, p = output(static, q, k, v_new, gamma, h, rel=rel, delta=beta is not None)
    return o, final, Residuals(q, k, v, gamma, beta, s.w, s.t, h, v_new, p, rel, s.q_seq, s.k_seq)


def _forward(static: Static, q, k, v, gamma, beta, h0, rel) -> tuple[jax.Array, jax.Array, Residuals]:
    """Padded inputs (``rel``: packed documents, ``reference.chunk_segments``, or None) -> ``(o, final state,
    residuals)``."""
    return from_start(static, q, k, v, gamma, beta, h0, rel, wy_stage(static, q, k, v, gamma, beta, rel))


def backward(static: Static, res: Residuals, do, dfinal):
    """The VJP of :func:`_forward` from its residuals and the cotangents of ``o`` and the final state (float32)."""
    B, T, H, K = res.q.shape
    do = do.astype(res.q.dtype)
    dh, dv_new, dh0, hdh = state_bwd(static, res, do, dfinal)
    if res.beta is None:
        dq, dk, dgamma = grad(static, res, dh, hdh, None, do)
        dv, dbeta = dv_new, None
    else:
        dq, dk, dgamma, dv, dbeta = grad(static, res, dh, hdh, dv_new, do)
        dbeta = dbeta.astype(res.beta.dtype)
    if dq.shape[2] != H:  # per value head: summed over the value heads of each q/k head
        group = (B, T, H, res.v.shape[2] // H, K)
        dq, dk = dq.reshape(group).sum(3), dk.reshape(group).sum(3)
    dq, dk = dq.astype(res.q.dtype), dk.astype(res.k.dtype)
    return dq, dk, dv, dgamma, dbeta, dh0, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(static: Static, q, k, v, gamma, beta, h0, rel):
    o, final, _ = _forward(static, q, k, v, gamma, beta, h0, rel)
    return o, final


def _chunked_fwd(static: Static, q, k, v, gamma, beta, h0, rel):
    o, final, res = _forward(static, q, k, v, gamma, beta, h0, rel)
    return (o, final), res


def _chunked_bwd(static: Static, res: Residuals, cts):
    do, dfinal = cts
    return backward(static, res, do, dfinal.astype(F32))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def per_batch_shard(fn, batch: int):
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
    (its VJP is the same sum, transposed), which XLA runs faster than ``jnp.cumsum``'s reduce-window; a scalar
    gate's, 1/K the size, stays ``jnp.cumsum``. A per-key chunk longer than ``SUB`` rows is summed in ``SUB``-row
    blocks, each block then offset by the totals of the chunk's earlier blocks, so that the broadcast stays ``SUB``
    x ``SUB`` per block at any chunk."""
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


def kernel_gate(g: jax.Array, C: int, cfg: RecurrentConfig) -> jax.Array:
    """XLA: the gate the kernels take, from ``g [B,T,HV]`` or ``[B,T,HV,K]`` float32 (T a multiple of ``C``): its chunk
    sums (:func:`chunk_local_cumsum`), or ``g`` itself where the kernels sum it (``RecurrentConfig.sums_gate``)."""
    return g if cfg.sums_gate(g.ndim == 4, C) else chunk_local_cumsum(g, C)


def _pow2_at_least_16(n: int) -> int:
    return max(16, pl.next_power_of_2(n))


class Padded(NamedTuple):
    """The op's inputs as the launches take them (:func:`prepare`): ``static``, padded ``q, k, v``, the kernels' gate
    ``gamma``, ``beta`` (or None), the start state ``h0 [B,HV,Kp,Vp]`` float32 and ``rel`` (packed documents, or
    None); ``T, K, V`` and ``dtype``: the caller's sizes and output dtype, to cut the results back to."""

    static: Static
    q: jax.Array
    k: jax.Array
    v: jax.Array
    gamma: jax.Array
    beta: jax.Array | None
    h0: jax.Array
    rel: jax.Array | None
    T: int
    K: int
    V: int
    dtype: jnp.dtype


def prepare(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm: bool, chunk_size, interpret: bool,
            config: RecurrentConfig | None, segment_ids) -> Padded:
    """:func:`chunk_recurrence`'s arguments -> :class:`Padded` (the XLA glue before the launches)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    op = recurrent_op(per_key=g.ndim == 4, delta=beta is not None)
    config = config or recurrent_config(per_key=g.ndim == 4, op=op, dims=(_pow2_at_least_16(K), _pow2_at_least_16(V)))
    C = config.chunk if chunk_size is None else chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {C}")
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = (l2_norm(a, eps=reference.L2NORM_EPS, interpret=interpret) for a in (q, k))
    out_dtype = v.dtype
    cd = jnp.promote_types(q.dtype, v.dtype)
    q, k, v = q.astype(cd), k.astype(cd), v.astype(cd)
    Tp, Kp, Vp = -(-T // C) * C, _pow2_at_least_16(K), _pow2_at_least_16(V)

    def pad(x, *widths):
        return jnp.pad(x, [(0, 0)] + [(0, w) for w in widths]) if any(widths) else x

    q, k = pad(q, Tp - T, 0, Kp - K), pad(k, Tp - T, 0, Kp - K)
    v = pad(v, Tp - T, 0, Vp - V)
    g = pad(g.astype(F32), Tp - T, 0, *([Kp - K] if g.ndim == 4 else []))
    gamma = kernel_gate(g, C, config)
    beta = None if beta is None else pad(beta, Tp - T, 0)
    h0 = jnp.zeros((B, HV, K, V), F32) if initial_state is None else initial_state.astype(F32)
    h0 = pad(h0, 0, Kp - K, Vp - V)
    rel = None if segment_ids is None else reference.chunk_segments(segment_ids, C)
    return Padded(Static(float(scale), C, config, interpret), q, k, v, gamma, beta, h0, rel, T, K, V, out_dtype)


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
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked GDN (``beta`` given, ``g [B,T,HV]``), KDA (``beta`` given, ``g [B,T,HV,K]``) or scalar-gated linear
    attention (``beta=None``) with Pallas kernels.

    Args:
      q, k: ``[B,T,H,K]``; v: ``[B,T,HV,V]`` (HV a multiple of H); g: ``[B,T,HV]`` or ``[B,T,HV,K]`` log decay;
      beta: ``[B,T,HV]`` or ``None``; initial_state: ``[B,HV,K,V]`` or ``None`` (zeros).
      chunk_size: a power of two >= 16; ``None``: the config's ``chunk`` (tuned per GPU and gate kind).
      interpret: run the kernels in Pallas interpret mode (CPU).
      config: launch parameters (default: ``tuning.recurrent_config()`` for the current device, op and head dims:
        the tuning file in use, else the built-in table).
      segment_ids: ``[B,T]`` int, packed documents (a nondecreasing document index), or ``None``: the state
        restarts at each new document (``reference.naive_recurrence``); the kernels then take each row's document
        relative to its chunk's carried one (``reference.chunk_segments``) and mask their products
        (``recurrent/segments.py``).

    Returns ``(o [B,T,HV,V] in v's dtype, final_state [B,HV,K,V] float32)``, the same function as
    :func:`hybrid_jax.kernels.reference.naive_recurrence`, differentiable in every array argument.
    """
    x = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                chunk_size=chunk_size, interpret=interpret, config=config, segment_ids=segment_ids)
    o, final = per_batch_shard(functools.partial(_chunked, x.static), q.shape[0])(
        x.q, x.k, x.v, x.gamma, x.beta, x.h0, x.rel)
    return o[:, :x.T, :, :x.V].astype(x.dtype), final[:, :, :x.K, :x.V]
