"""The chunked recurrence as one differentiable op: XLA glue around the Pallas launches, under ``jax.custom_vjp``.

XLA does the cheap elementwise work: padding (T to a multiple of the chunk, K and V to powers of two >= 16), the
optional L2 norm of q and k, the chunk-local gate cumsum (its VJP is the reverse cumsum; or the kernels sum the gate:
``RecurrentConfig.sums_gate``), the far-chunk flags of the levels launches, and the sum of q/k gradients over
grouped value heads. Launches: forward ``wy`` -> ``state_fwd`` -> ``output``; backward ``state_bwd`` -> ``grad``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hybrid_jax.kernels import reference
from hybrid_jax.kernels.recurrent.backward import Residuals, grad, state_bwd
from hybrid_jax.kernels.recurrent.block_math import F32, SUB
from hybrid_jax.kernels.recurrent.forward import output, state_fwd, wy
from hybrid_jax.kernels.recurrent.launch import Static
from hybrid_jax.kernels.recurrent.segments import sequential_qk
from hybrid_jax.kernels.tuning import RecurrentConfig, recurrent_config, recurrent_op


def _forward(static: Static, q, k, v, gamma, beta, h0, rel) -> tuple[jax.Array, jax.Array, Residuals]:
    """Padded inputs (``rel``: packed documents, ``reference.chunk_segments``, or None) -> ``(o, final state,
    residuals)``."""
    q_seq, k_seq = sequential_qk(q, k, rel, static.chunk)
    if beta is not None and static.cfg.output_in_state_at(k.shape[-1], v.shape[-1]):
        u, w, t, p = wy(static, k, v, gamma, beta, q, rel=rel)
        h, v_new, final, o = state_fwd(static, k_seq, gamma, w, u, h0, q_seq, p, rel=rel)
        return o, final, Residuals(q, k, v, gamma, beta, w, t, h, v_new, p, rel, q_seq, k_seq)
    u, w, t = wy(static, k, v, gamma, beta, rel=rel) if beta is not None else (v, None, None)
    h, v_new, final = state_fwd(static, k_seq, gamma, w, u, h0, rel=rel)
    o, p = output(static, q, k, v_new, gamma, h, rel=rel, delta=beta is not None)
    return o, final, Residuals(q, k, v, gamma, beta, w, t, h, v_new, p, rel, q_seq, k_seq)


def _backward(static: Static, res: Residuals, do, dfinal):
    B, T, H, K = res.q.shape
    do = do.astype(res.q.dtype)
    dh, dv_new, dh0, hdh = state_bwd(static, res, do, dfinal)
    if res.beta is None:
        dq, dk, dgamma = grad(static, res, dh, hdh, None, do)
        dv, dbeta = dv_new, None
    else:
        dq, dk, dgamma, dv, dbeta = grad(static, res, dh, hdh, dv_new, do)
        dbeta = dbeta.astype(res.beta.dtype)
    group = (B, T, H, res.v.shape[2] // H, K)
    dq = dq.reshape(group).sum(3).astype(res.q.dtype)
    dk = dk.reshape(group).sum(3).astype(res.k.dtype)
    return dq, dk, dv.astype(res.v.dtype), dgamma, dbeta, dh0, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(static: Static, q, k, v, gamma, beta, h0, rel):
    o, final, _ = _forward(static, q, k, v, gamma, beta, h0, rel)
    return o, final


def _chunked_fwd(static: Static, q, k, v, gamma, beta, h0, rel):
    o, final, res = _forward(static, q, k, v, gamma, beta, h0, rel)
    return (o, final), res


def _chunked_bwd(static: Static, res: Residuals, cts):
    do, dfinal = cts
    return _backward(static, res, do, dfinal.astype(F32))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


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
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    op = recurrent_op(per_key=g.ndim == 4, delta=beta is not None)
    config = config or recurrent_config(per_key=g.ndim == 4, op=op, dims=(_pow2_at_least_16(K), _pow2_at_least_16(V)))
    C = config.chunk if chunk_size is None else chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {C}")
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
    gamma = kernel_gate(g, C, config)
    beta = None if beta is None else pad(beta, Tp - T, 0)
    h0 = jnp.zeros((B, HV, K, V), F32) if initial_state is None else initial_state.astype(F32)
    h0 = pad(h0, 0, Kp - K, Vp - V)
    rel = None if segment_ids is None else reference.chunk_segments(segment_ids, C)
    static = Static(float(scale), C, config, interpret)
    o, final = _per_batch_shard(functools.partial(_chunked, static), B)(q, k, v, gamma, beta, h0, rel)
    return o[:, :T, :, :V].astype(out_dtype), final[:, :, :K, :V]
