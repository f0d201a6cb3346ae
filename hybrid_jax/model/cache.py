"""Decoding caches: the per-sublayer state a model carries from one generated token to the next.

* recurrent mixers (GDN, KDA, Mamba2): :class:`RecurrentCache`, a fixed-size float32 state ``[B,HV,K,V]`` plus the
  short-conv tail (the last ``conv_size - 1`` conv inputs ``[B,K-1,C]``);
* MLA: :class:`MLACache`, the compressed latent after ``kv_layernorm`` ``[B,S,kv_lora_rank]`` and the roped shared
  key ``[B,S,qk_rope_head_dim]`` for each of ``S = max_len`` positions (never the per-head K/V);
* MLP: nothing (``None``).

:class:`Cache` holds one entry per sublayer and the number of tokens each sequence has consumed (``lengths [B]``).
:func:`compile_decoder` jit-compiles a model's ``prefill`` and ``decode_step`` for a fixed cache size.
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
