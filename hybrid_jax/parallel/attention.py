"""Causal softmax attention of one context shard's queries over the whole sequence's keys (gathered by the caller:
MLA gathers its compressed latent, ``hybrid_jax.model.mla``).

Plain float32 softmax in XLA, the same math as ``kernels.reference.naive_attention`` (what ``impl="xla"`` runs), with
the causal mask taken at the queries' global positions: ``[B, H, T_local, T]`` scores per shard. Nothing here is a
flash kernel yet: on a GPU this is the slow plain-XLA attention, and the last shard does the most work (its queries
see every key; no load balancing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def attention_at(q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array, scale: float | None = None,
                 q_segment_ids: jax.Array | None = None, k_segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention of queries at global ``positions`` over keys at positions ``0 .. S-1``.

    Args:
      q: ``[B, Tq, H, Dqk]``, the queries at ``positions [Tq]`` int (this shard's global positions).
      k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]``: the whole sequence's keys and values.
      scale: ``Dqk**-0.5`` when None.
      q_segment_ids: ``[B, Tq]``, k_segment_ids: ``[B, S]`` (packed documents, both or neither): a query sees only
        keys of its own document.
    Returns ``[B, Tq, H, Dv]`` in ``v``'s dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32), k.astype(F32)) * scale
    visible = (positions[:, None] >= jnp.arange(k.shape[1])[None, :])[None]  # [1, Tq, S]
    if q_segment_ids is not None:
        visible = visible & (q_segment_ids[:, :, None] == k_segment_ids[:, None, :])  # [B, Tq, S]
    s = jnp.where(visible[:, None], s, -jnp.inf)  # every query sees itself: no row is all -inf
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(F32)).astype(v.dtype)
