"""GDN, KDA and Mamba2's SSD (GLA) with the time axis split over a context axis: exact, with states and documents.

The same functions as ``hybrid_jax.kernels.chunk_gated_delta_rule`` / ``chunk_kda`` / ``chunk_simple_gla``, called
inside a ``shard_map`` on each shard's ``[B, T_local, ...]`` part, plus the axis name. Per value head the state
recurrence is affine in the state a shard starts from::

    delta rule:  S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = (I - beta_t k_t k_t^T) D_t     (D_t = diag(exp(g_t)))
    GLA:         S_t = exp(g_t) S_{t-1} + k_t v_t^T

so a shard's final state is ``M S_in + S_local`` (``M = A_T ... A_1``, ``[K, K]``; for GLA the scalar
``exp(sum g)``). Each shard computes its pair ``(M, S_local)`` from a zero state, all-gathers the pairs and a flag
per row (whether its first token continues the previous shard's last document), runs the exclusive prefix
``S_in(i+1) = keep(i+1) (M_i S_in(i) + S_local(i))`` (``kernels/recurrent/prefix.py::shard_prefix``, ``log2 n``
levels of small matmuls, the same on every shard) from the caller's ``initial_state`` on shard 0, and gives its
exact outputs:

* the delta rule with the Pallas kernels: ``kernels/recurrent/context.py`` (the pair from a state pass that keeps
  its final state alone, then the plain kernels from ``S_in``; its backward passes the end state's gradient back
  the same way, under its own VJP; each state pass runs the shard's chunks in groups side by side, chained the same
  way inside the shard);
* the delta rule in XLA (the reference of that): the kernel runs once on ``[v | 0]`` (value width ``V + K``) from
  ``[0 | I]``, whose last ``K`` state columns evolve as ``M_t`` (they see no ``v``): the final state is ``[S_local |
  M]``, the first ``V`` output channels ``o_local`` and the last ``K`` ``scale M_t^T q_t``; the outputs are then
  completed, ``o = o_local + (scale M_t^T q_t) S_in``; ``jax.grad`` transposes it all;
* GLA: the pair in closed form, ``S_local = sum_t exp(G_T - G_t) k_t v_t^T`` and ``M = exp(G_T)`` (``G`` the
  cumulative log decay), no kernel; the kernel then runs once, from ``S_in``: with the Pallas kernels in
  ``kernels/recurrent/context.py`` too (its backward as the delta rule's), in XLA under ``jax.grad``.

A document that starts inside a shard cuts the prefix: the kernel's segment ids reset the ``[0 | I]`` columns to 0
there, so ``M`` and ``M_t`` after it are 0 (GLA: ``S_local`` sums the shard's last document only and ``M`` is 0).
The returned final state is the whole sequence's (the last shard's, the same on every shard).

``axis``: the mesh axis' name, or any object with :class:`hybrid_jax.parallel.shards.Shards`' methods (a
benchmark's stand-in for ``n`` shards on one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax import kernels
from hybrid_jax.kernels.api import Impl
from hybrid_jax.kernels.recurrent.context import chunk_recurrence_sharded, gla_pair
from hybrid_jax.kernels.recurrent.prefix import shard_prefix
from hybrid_jax.kernels.registry import resolve_impl
from hybrid_jax.parallel.shards import Shards

F32 = jnp.float32


def _shards(axis: str | Shards) -> Shards:
    return Shards(axis) if isinstance(axis, str) else axis


def _continues(segment_ids: jax.Array | None, batch: int, shards: Shards) -> jax.Array:
    """``[B]`` bool: this shard's first token is in the document the previous shard ends in (always, without ids)."""
    if segment_ids is None:
        return jnp.ones((batch,), bool)
    return segment_ids[:, 0] == shards.previous_tail(segment_ids, 1, fill=-1)[:, 0]


def _start_states(transition: jax.Array, local: jax.Array, keep: jax.Array, initial_state: jax.Array | None,
                  shards: Shards) -> tuple[jax.Array, jax.Array]:
    """The exclusive prefix over the shards of ``S -> M S + S_local``: all-gathers this shard's ``transition`` (``M``,
    ``[B, HV, K, K]`` or ``[B, HV]``), ``local`` (``S_local [B, HV, K, V]``) and ``keep`` (``[B]``), then
    ``shard_prefix``."""
    gathered = (shards.gather(transition.astype(F32)), shards.gather(local), shards.gather(keep))
    starts, final = shard_prefix(*gathered, initial_state)
    return starts[shards.index()], final


def _widened_delta_rule(kernel, q, k, v, g, beta, *, scale, use_qk_l2norm: bool, chunk_size, impl: Impl, segment_ids
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Step 1 of the delta rule on a shard: ``kernel`` (GDN's or KDA's) once on ``[v | 0]`` from ``[0 | I]``.
    Returns ``(o_local [B,T,HV,V], q_through = scale M_t^T q_t [B,T,HV,K], M [B,HV,K,K], S_local [B,HV,K,V])``."""
    B, _, HV, V = v.shape
    K = q.shape[-1]
    ext_v = jnp.concatenate([v, jnp.zeros((*v.shape[:3], K), v.dtype)], axis=-1)  # [B,T,HV,V+K]
    eye = jnp.broadcast_to(jnp.eye(K, dtype=F32), (B, HV, K, K))
    ext_h0 = jnp.concatenate([jnp.zeros((B, HV, K, V), F32), eye], axis=-1)  # [B,HV,K,V+K]
    o_ext, h_ext = kernel(q, k, ext_v, g, beta, scale=scale, initial_state=ext_h0, output_final_state=True,
                          use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl, segment_ids=segment_ids)
    return o_ext[..., :V], o_ext[..., V:], h_ext[..., V:], h_ext[..., :V]


def _complete_delta_rule(o_local: jax.Array, q_through: jax.Array, start: jax.Array) -> jax.Array:
    """Step 3: ``o = o_local + (scale M_t^T q_t) S_in`` (``start = S_in [B,HV,K,V]``) in ``o_local``'s dtype."""
    o = o_local.astype(F32) + jnp.einsum("bthk,bhkv->bthv", q_through.astype(F32), start)
    return o.astype(o_local.dtype)


def _on_shard(kernel, q, k, v, g, beta, *, axis: str | Shards, scale, initial_state, output_final_state: bool,
              use_qk_l2norm: bool, chunk_size, impl: Impl, segment_ids):
    """GDN, KDA or GLA (``kernel``, ``beta=None``) on this shard's part; see the module docstring."""
    shards = _shards(axis)
    keep = _continues(segment_ids, q.shape[0], shards)
    impl = resolve_impl(impl, kernel.__name__)
    if impl in ("pallas", "pallas_interpret"):
        return chunk_recurrence_sharded(q, k, v, g, beta, exchange=shards, keep=keep, scale=scale,
                                        initial_state=initial_state, output_final_state=output_final_state,
                                        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                        interpret=impl == "pallas_interpret", segment_ids=segment_ids)
    if beta is None:  # GLA: the kernel once, from the start state
        last_doc = None if segment_ids is None else segment_ids == segment_ids[:, -1:]
        transition, local = gla_pair(k, v, jnp.cumsum(g.astype(F32), axis=1), last_doc)
        start, final = _start_states(transition, local, keep, initial_state, shards)
        o, _ = kernel(q, k, v, g, scale=scale, initial_state=start, chunk_size=chunk_size, impl=impl,
                      segment_ids=segment_ids)
    else:
        o_local, q_through, transition, local = _widened_delta_rule(
            kernel, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl,
            segment_ids=segment_ids)
        start, final = _start_states(transition, local, keep, initial_state, shards)
        o = _complete_delta_rule(o_local, q_through, start)
    return o, (final if output_final_state else None)


def chunk_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, axis: str | Shards,
    scale: float | None = None, initial_state: jax.Array | None = None, output_final_state: bool = False,
    use_qk_l2norm: bool = False, chunk_size: int | None = None, impl: Impl = "auto",
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`hybrid_jax.kernels.chunk_gated_delta_rule` on this shard of ``axis``: ``q, k [B,T_local,H,K]``, ``v
    [B,T_local,HV,V]``, ``g, beta [B,T_local,HV]``, ``segment_ids [B,T_local]`` (this shard's part of the sequence's);
    ``initial_state [B,HV,K,V]``: the sequence's (used by shard 0). Returns ``(o [B,T_local,HV,V], the sequence's
    final state [B,HV,K,V] float32 or None)``."""
    return _on_shard(kernels.chunk_gated_delta_rule, q, k, v, g, beta, axis=axis, scale=scale,
                       initial_state=initial_state, output_final_state=output_final_state,
                       use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, impl=impl, segment_ids=segment_ids)


def chunk_kda(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, axis: str | Shards,
    scale: float | None = None, initial_state: jax.Array | None = None, output_final_state: bool = False,
    use_qk_l2norm: bool = False, chunk_size: int | None = None, impl: Impl = "auto",
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`hybrid_jax.kernels.chunk_kda` on this shard of ``axis`` (``g [B,T_local,HV,K]``); as
    :func:`chunk_gated_delta_rule`."""
    return _on_shard(kernels.chunk_kda, q, k, v, g, beta, axis=axis, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                       impl=impl, segment_ids=segment_ids)


def chunk_simple_gla(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, *, axis: str | Shards, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, chunk_size: int | None = None,
    impl: Impl = "auto", segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`hybrid_jax.kernels.chunk_simple_gla` (Mamba2's SSD) on this shard of ``axis``; as
    :func:`chunk_gated_delta_rule`. The shard's pair (in closed form: ``gla_pair``) needs no kernel, so the kernel runs
    once, from the shard's true start state: no completion pass."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _on_shard(kernels.chunk_simple_gla, q, k, v, g, None, axis=axis, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm=False, chunk_size=chunk_size, impl=impl,
                     segment_ids=segment_ids)
