"""Decoding caches: the per-sublayer state a model carries from one generated token to the next.

* recurrent mixers (GDN, KDA, Mamba2): :class:`RecurrentCache`, a fixed-size float32 state ``[B,HV,K,V]`` plus the
  short-conv tail (the last ``conv_size - 1`` conv inputs ``[B,K-1,C]``);
* MLA: :class:`MLACache`, the compressed latent after ``kv_layernorm`` ``[B,S,kv_lora_rank]`` and the roped shared
  key ``[B,S,qk_rope_head_dim]`` for each of ``S = max_len`` positions (never the per-head K/V);
* MLP: nothing (``None``).

:class:`Cache` holds one entry per sublayer, the number of tokens each sequence has consumed (``lengths [B]``) and
where its current document starts (``starts [B]``: 0, unless a prompt of packed documents was prefilled with its
segment ids; attention reads no key before it and, with ``model.reset_positions``, counts RoPE positions from it).
:func:`compile_decoder` jit-compiles a model's ``prefill`` and ``decode_step`` for a fixed cache size;
:func:`compile_context_prefill` a prefill with the prompt's time axis split over a mesh axis (context parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class RecurrentCache(NamedTuple):
    state: jax.Array  # [B, HV, K, V] float32
    conv: jax.Array  # [B, conv_size - 1, C] conv inputs, compute dtype


class MLACache(NamedTuple):
    latent: jax.Array  # [B, S, kv_lora_rank] normalised latent, compute dtype
    k_rope: jax.Array  # [B, S, qk_rope_head_dim] roped shared key, compute dtype


class Cache(NamedTuple):
    layers: tuple[RecurrentCache | MLACache | None, ...]  # one per sublayer
    lengths: jax.Array  # [B] int32: tokens consumed so far (= position of the next token)
    starts: jax.Array  # [B] int32: position of the current document's first token (keys before it are not attended)


def cache_bytes(cache: Any) -> int:
    """Total bytes of the arrays in a cache pytree (concrete or ``jax.ShapeDtypeStruct``)."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))


Prefill = Callable[[jax.Array, jax.Array, Cache], tuple[jax.Array, Cache]]
Step = Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]


def compile_decoder(model: nnx.Module) -> tuple[Prefill, Step]:
    """``(prefill(tokens [B,T], lengths [B], cache), decode_step(token [B], cache))`` of ``model``, jitted.

    Both return ``(logits [B,V] float32, cache)``; the cache buffers are donated. One compilation per cache size
    (and per prompt length for prefill).
    """
    graphdef, state = nnx.split(model)

    @partial(jax.jit, donate_argnums=3)
    def prefill(state, tokens, lengths, cache):
        return nnx.merge(graphdef, state).prefill(tokens, lengths, cache)

    @partial(jax.jit, donate_argnums=2)
    def step(state, token, cache):
        return nnx.merge(graphdef, state).decode_step(token, cache)

    return (lambda tokens, lengths, cache: prefill(state, tokens, lengths, cache),
            lambda token, cache: step(state, token, cache))


ContextPrefill = Callable[[jax.Array, jax.Array | None], tuple[jax.Array, Cache]]


def compile_context_prefill(model: nnx.Module, mesh: jax.sharding.Mesh, max_len: int, axis: str = "context"
                            ) -> ContextPrefill:
    """``prefill(tokens [B,T], segment_ids [B,T] or None) -> (logits [B,V] float32, cache)`` of ``model``, jitted,
    with the prompts' time axis split over ``mesh``'s axis ``axis`` (``T`` a multiple of its size, every row ``T``
    real tokens; ``HybridLM.context_prefill`` on each shard). The logits are the last token's and the cache holds
    ``max_len`` positions, both replicated over the mesh: decoding goes on with ``decode_step`` (on any device).
    With ``segment_ids`` (packed documents) each row's generation continues its last document."""
    graphdef, state = nnx.split(model)
    time = jax.sharding.PartitionSpec(None, axis)

    def local(state, tokens, segment_ids):
        return nnx.merge(graphdef, state).context_prefill(tokens, segment_ids, max_len, axis)

    @jax.jit
    def prefill(state, tokens, segment_ids):
        # check_vma=False: the kernels' scans start from states made inside them (parallel.recurrence)
        run = jax.shard_map(local, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), time,
                                                        None if segment_ids is None else time),
                            out_specs=jax.sharding.PartitionSpec(), check_vma=False)
        return run(state, tokens, segment_ids)

    return lambda tokens, segment_ids=None: prefill(state, tokens, segment_ids)
