"""The chunked recurrences (GDN, KDA, GLA) on one shard of a sequence split over devices (context parallelism):
exact, in two passes.

Per value head the state recurrence is affine in the state a shard starts from: its end state is ``M S_in +
S_local`` (``M`` the shard's transition, ``[K, K]`` for the delta rule, a scalar per head for GLA; ``S_local`` its
end state from a zero start). Inside a ``shard_map`` over the time axis, each shard, with ``n`` shards in all:

forward
  1. the WY transform (the delta rule; once, shared by 2 and 4);
  2. its pair ``(M, S_local)``, from each group's (below) chained (``prefix.scan``). The delta rule's: one state pass on
     ``[u | 0]`` from ``[0 | I]`` (value width ``V + K``) that keeps its final state alone, ``[S_local | M]`` (the
     last ``K`` columns see no ``u``, so they evolve as ``M_t``). GLA's in closed form (:func:`gla_pair`: one
     weighted product per head, no kernel);
  3. gathers every shard's pair and ``prefix.shard_prefix`` gives its true start state ``S_in`` and the sequence's
     final state;
  4. the plain forward (state pass, output) from each group's start state (the prefix over the groups from
     ``S_in``): its outputs are exact, its residuals the plain ones.

backward
  5. the reverse state pass alone from a zero end gradient: ``dS_own``, the gradient of its own outputs with respect
     to its start state (each group's, chained back: ``prefix.suffix``);
  6. gathers every shard's ``dS_own`` and ``prefix.reverse_prefix`` gives ``dS_end``, the gradient of its end state from
     every later shard and the final state;
  7. the plain backward from each group's end-state gradient (the reverse prefix over the groups from ``dS_end``):
     every input's gradient, exact (the shard's end state is ``M S_in + S_local`` and later shards see it only
     through that).

Groups (:func:`group_count`): a shard of one sequence gives a state pass few programs (batch x value heads x V
tiles), and such a pass's time is its number of chunk steps with most of the GPU idle, so every state pass above
runs the shard's ``N`` chunks as ``G`` groups of ``N / G`` side by side (rows of the batch: the kernels' inputs
are chunk-local), chained inside the shard by the same affine form as across the shards.

Against the plain call on the shard this adds the pair (the delta rule: one forward state pass of width ``V + K``
that writes nothing but its final state), one reverse state pass that writes nothing but its start gradient, and
the chains over the groups and over the shards (``kernels/recurrent/prefix.py``: ``log2 G`` and ``log2 n`` levels
of small products per head each way, the shards' the same on every shard); with groups the plain passes take ``N /
G`` steps, where the plain call takes ``N``. The collectives move ``K (K + V)`` floats per head forward (GLA: ``K V
+ 1``) and ``K V`` back. ``hybrid_jax.parallel.recurrence`` calls it for the Pallas kernels; its XLA form (the
delta rule: one widened call and a completion product; GLA: the pair, then the kernel from ``S_in``, under
``jax.grad``) is the reference it is tested against, with the token-by-token recurrence.

A document that starts inside a shard cuts the prefix: the kernels' segment ids reset the ``[0 | I]`` columns to 0
there (``M`` = 0; GLA: ``S_local`` sums the shard's last document only and ``M`` is 0), and a shard whose first
token starts a document (``keep`` false) starts from 0.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.recurrent import prefix
from hybrid_jax.kernels.recurrent.backward import state_bwd
from hybrid_jax.kernels.recurrent.block_math import F32
from hybrid_jax.kernels.recurrent.forward import state_fwd
from hybrid_jax.kernels.recurrent.launch import Static
from hybrid_jax.kernels.recurrent.op import WY, backward, from_start, per_batch_shard, prepare, wy_stage


class Exchange(Protocol):
    """What a shard needs from the others (``hybrid_jax.parallel.shards.Shards`` over a mesh axis; a benchmark's
    stand-in on one device). Hashable: it is a static argument of the op."""

    def gather(self, x: jax.Array) -> jax.Array:
        """Every shard's ``x`` stacked in shard order: ``[n, *x.shape]``."""

    def index(self) -> jax.Array:
        """This shard's index (int32 scalar)."""

    def total(self, x: jax.Array) -> jax.Array:
        """The sum of ``x`` over the shards."""


MAX_GROUPS = 8  # at 8 a shard's passes are already a few dozen chunk steps; each doubling adds a level to the chains


def group_count(n_chunks: int, programs: int) -> int:
    """How many groups of consecutive chunks a shard's state passes, of ``programs`` programs each, run side by side
    (module docstring, "Groups"): the largest power of two that divides ``n_chunks``, is at most :data:`MAX_GROUPS`
    and keeps the programs within four per core of ``tuning.target_device`` (132 cores where it does not say)."""
    cores = tuning.target_device().cores or 132
    groups = 1
    while 2 * groups <= MAX_GROUPS and n_chunks % (2 * groups) == 0 and 2 * groups * programs <= 4 * cores:
        groups *= 2
    return groups


def _split(x: jax.Array | None, groups: int) -> jax.Array | None:
    """``[B, L, ...] -> [B G, L / G, ...]``: each row's ``G`` groups of consecutive steps (tokens or chunks) as rows
    (the kernels' inputs are chunk-local, so a group's pass is the shard's own from the group's start)."""
    if x is None or groups == 1:
        return x
    return x.reshape(x.shape[0] * groups, x.shape[1] // groups, *x.shape[2:])


def gla_pair(k: jax.Array, v: jax.Array, log_decay: jax.Array, last_doc: jax.Array | None
             ) -> tuple[jax.Array, jax.Array]:
    """GLA's pair in closed form: the end state from a zero start ``S_local = sum_t exp(G_T - G_t) k_t v_t^T`` over the
    shard's last document, one ``[K, T] x [T, V]`` product per value head in float32 (unrounded: as close as the
    sequence's own final state), and the transition ``exp(G_T)`` (0 where a document starts inside the shard).

    Args: ``k [B,T,H,K]``, ``v [B,T,HV,V]`` (value head ``hv`` reads key head ``hv // (HV / H)``), ``log_decay
    [B,T,HV]`` float32 (``G``, the cumulative log decay from the shard's start), ``last_doc [B,T]`` bool (the token
    is in the shard's last document) or None (one document). Returns ``(M [B,HV], S_local [B,HV,K,V])`` float32."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    weight = jnp.exp(log_decay[:, -1:] - log_decay)  # exp(G_T - G_t) <= 1
    transition = jnp.exp(log_decay[:, -1])
    if last_doc is not None:
        weight = jnp.where(last_doc[:, :, None], weight, 0.0)
        transition = jnp.where(last_doc[:, :1], transition, 0.0)
    weighted = (v.astype(F32) * weight[..., None]).reshape(B, T, H, HV // H, V)
    local = jnp.einsum("bthk,bthgv->bhgkv", k.astype(F32), weighted, precision=jax.lax.Precision.HIGHEST)
    return transition, local.reshape(B, HV, K, V)


def _chunk_totals(gamma: jax.Array, C: int) -> jax.Array:
    """Each chunk's summed log decay ``[B, T/C, HV]``: the last row of the kernels' scalar gate in each chunk of ``C``
    (its sums within each chunk: ``op.kernel_gate``; a scalar gate is always summed by XLA)."""
    B, T, HV = gamma.shape
    return gamma.reshape(B, T // C, C, HV)[:, :, -1]


def _log_decay(gamma: jax.Array, C: int) -> jax.Array:
    """``G [B,T,HV]``, the cumulative log decay from the shard's start, from the kernels' scalar gate."""
    B, T, HV = gamma.shape
    ends = _chunk_totals(gamma, C)
    return (gamma.reshape(B, T // C, C, HV) + (jnp.cumsum(ends, axis=1) - ends)[:, :, None]).reshape(gamma.shape)


def _gla_steps(gamma: jax.Array, rel: jax.Array | None, C: int, groups: int) -> jax.Array:
    """GLA's transition over each of ``groups`` groups of consecutive chunks, ``[G, B, HV]``: ``exp`` of the group's
    summed log decay (``gamma [B,T,HV]``: the kernels' gate, summed within each chunk), 0 where a document starts in
    it (a chunk of ``rel`` whose last row is not in the document it carries in)."""
    B, T, HV = gamma.shape
    ends = _chunk_totals(gamma, C)
    if rel is not None:
        ends = jnp.where(rel.reshape(B, T // C, C)[:, :, -1:] == 0, ends, -jnp.inf)
    return jnp.exp(jnp.sum(ends.reshape(B, groups, -1, HV), axis=2)).swapaxes(0, 1)


def _group_pairs(static: Static, s: WY, gamma: jax.Array, rel: jax.Array | None, seg: jax.Array | None,
                 k: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
    """Step 2, per group of chunks: ``(M [G,B,HV,K,K], S_local [G,B,HV,K,V])`` float32. The delta rule: one state pass
    from ``[0 | I]`` (the value width rounded up to the state launch's V tile) over the groups side by side, its
    columns past ``u``'s seeing a zero input (``forward.state_fwd``'s wider start: no zeros are written). GLA (no
    ``w``; ``M [G,B,HV]``): :func:`_gla_steps` and :func:`gla_pair` over each group's last document (``seg [B,T]``: the
    shard's segment ids, padding continuing the last; None: one)."""
    split = functools.partial(_split, groups=groups)
    B = k.shape[0]
    if s.w is None:
        last_doc = None if seg is None else split(seg) == split(seg)[:, -1:]
        _, local = gla_pair(split(k), split(s.u), _log_decay(split(gamma), static.chunk), last_doc)
        return _gla_steps(gamma, rel, static.chunk, groups), _by_group(local, groups)
    _, _, HV, V = s.u.shape
    K = s.k_seq.shape[-1]
    tile = min(static.cfg.block_v, V + K)
    extra = K + (-(V + K)) % tile
    eye = jnp.broadcast_to(jnp.eye(K, extra, dtype=F32), (B * groups, HV, K, extra))
    start = jnp.concatenate([jnp.zeros((B * groups, HV, K, V), F32), eye], axis=-1)
    u = s.u if V % tile == 0 else jnp.pad(s.u, ((0, 0), (0, 0), (0, 0), (0, (-V) % tile)))  # whole V tiles of u
    (end,) = state_fwd(static, *map(split, (s.k_seq, gamma, s.w, u)), start, rel=split(rel), final_only=True)
    end = _by_group(end, groups)
    return end[..., V:V + K], end[..., :V]


def _groups(static: Static, v: jax.Array, K: int, delta: bool) -> int:
    """:func:`group_count` for this shard's state passes (``v [B,T,HV,V]`` padded, ``K`` the padded key dim), by the
    fewest programs of them: the plain forward's and the reverse passes' (value width ``V``), the delta rule's pair
    (``V + K``)."""
    B, T, HV, V = v.shape
    tiles = min(V // min(static.cfg.block_v, V), V // min(static.cfg.state_bwd_block_v(delta), V))
    if delta:
        tiles = min(tiles, -(-(V + K) // min(static.cfg.block_v, V + K)))
    return group_count(T // static.chunk, B * HV * tiles)


def _by_group(rows: jax.Array, groups: int) -> jax.Array:
    """The rows of :func:`_split` ``[B G, ...] -> [G, B, ...]``: groups first, as ``kernels/recurrent/prefix.py``
    takes parts."""
    return rows.reshape(-1, groups, *rows.shape[1:]).swapaxes(0, 1)


def _rows(x: jax.Array) -> jax.Array:
    """The inverse of :func:`_by_group`: ``[G, B, ...] -> [B G, ...]``."""
    return jnp.moveaxis(x, 0, 1).reshape(-1, *x.shape[2:])


def _joined(x: jax.Array | None, batch: int) -> jax.Array | None:
    """The inverse of :func:`_split`: ``[B G, L / G, ...] -> [B, L, ...]``."""
    return None if x is None else x.reshape(batch, -1, *x.shape[2:])


def _forward(static: Static, exchange: Exchange, q, k, v, gamma, beta, h0, rel, keep, seg):
    """Steps 1-4, the state passes over the groups of :func:`_groups` side by side (the plain one from each group's
    start state: the prefix over the groups from the shard's). The residuals are in the groups' rows."""
    B, groups = q.shape[0], _groups(static, v, q.shape[-1], beta is not None)
    split = functools.partial(_split, groups=groups)
    s = wy_stage(static, q, k, v, gamma, beta, rel)
    steps = _group_pairs(static, s, gamma, rel, seg, k, groups)
    chains = prefix.scan(*steps)  # groups 0..g, for each g
    transitions, locals_, keeps = (exchange.gather(x) for x in (chains[0][-1], chains[1][-1], keep))
    index = exchange.index()
    starts, final = prefix.shard_prefix(transitions, locals_, keeps, h0)
    group_starts, _ = prefix.starts(chains, starts[index])
    o, _, res = from_start(static, *map(split, (q, k, v, gamma, beta)), _rows(group_starts), split(rel),
                           WY(*map(split, s)))
    return _joined(o, B), final, (res, transitions, keeps, index, steps[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _sharded(static: Static, exchange: Exchange, with_final: bool, q, k, v, gamma, beta, h0, rel, keep, seg):
    o, final, _ = _forward(static, exchange, q, k, v, gamma, beta, h0, rel, keep, seg)
    return o, final


def _sharded_fwd(static: Static, exchange: Exchange, with_final: bool, q, k, v, gamma, beta, h0, rel, keep, seg):
    o, final, saved = _forward(static, exchange, q, k, v, gamma, beta, h0, rel, keep, seg)
    return (o, final), saved


def _sharded_bwd(static: Static, exchange: Exchange, with_final: bool, saved, cts):
    """Steps 5-7 over the forward's groups: each group's own start gradient, chained to the shard's for the exchange;
    the plain backward from each group's end-state gradient (the reverse prefix over the groups from the shard's)."""
    res, transitions, keeps, index, steps = saved  # steps: each group's M, [G, B, HV, K, K] (or [G, B, HV])
    do, d_final = cts
    groups, B = steps.shape[:2]
    do = _split(do.astype(res.q.dtype), groups)
    zero = jnp.zeros((B * groups, *d_final.shape[1:]), F32)
    (own,) = state_bwd(static, res, do, zero, start_only=True)
    own = _by_group(own, groups)  # [G, B, HV, K, V]: each group's own
    to_end, from_own = prefix.suffix(steps, own, None)  # group g's end gradient: to_end[g] d_end + from_own[g]
    own = own[0] + prefix.carry(steps[0], from_own[0], transpose=True)  # the shard's start, from all its outputs
    d_final = exchange.total(d_final.astype(F32)) if with_final else jnp.zeros(d_final.shape, F32)
    d_end = prefix.reverse_prefix(transitions, exchange.gather(own), keeps, d_final)[index]
    d_ends = prefix.ends(to_end, from_own, d_end)
    dq, dk, dv, dgamma, dbeta, d_start, _ = backward(static, res, do, _rows(d_ends))
    d_start = d_start.reshape(B, groups, *d_start.shape[1:])[:, 0]
    grads = (_joined(x, B) for x in (dq, dk, dv, dgamma, dbeta))
    return *grads, jnp.where(index == 0, d_start, 0.0), None, None, None


_sharded.defvjp(_sharded_fwd, _sharded_bwd)


def chunk_recurrence_sharded(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array | None, *, exchange: Exchange,
    keep: jax.Array, scale: float | None = None, initial_state: jax.Array | None = None,
    output_final_state: bool = False, use_qk_l2norm: bool = False, chunk_size: int | None = None,
    interpret: bool = False, segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """GDN (``g [B,T,HV]``), KDA (``g [B,T,HV,K]``) or GLA (``beta=None``) on this shard's ``[B, T_local]`` part, with
    the Pallas kernels (as ``recurrent.chunk_recurrence``).

    ``keep [B]`` bool: this shard's first token continues the previous shard's last document (always true without
    documents; shard 0's is unused); ``initial_state [B,HV,K,V]``: the sequence's (shard 0's start);
    ``segment_ids``: this shard's part of the sequence's. Returns ``(o [B,T_local,HV,V] in v's dtype, the
    sequence's final state [B,HV,K,V] float32 (the same on every shard) or None)``, differentiable in every array
    argument but ``keep`` and ``segment_ids``."""
    x = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                chunk_size=chunk_size, interpret=interpret, config=None, segment_ids=segment_ids)
    seg = None  # GLA's pairs: the documents (padding continues the last)
    if beta is None and segment_ids is not None:
        seg = jnp.pad(segment_ids, ((0, 0), (0, x.q.shape[1] - x.T)), mode="edge")
    run = functools.partial(_sharded, x.static, exchange, output_final_state)
    o, final = per_batch_shard(run, q.shape[0])(x.q, x.k, x.v, x.gamma, x.beta, x.h0, x.rel, keep, seg)
    return o[:, :x.T, :, :x.V].astype(x.dtype), (final[:, :, :x.K, :x.V] if output_final_state else None)
