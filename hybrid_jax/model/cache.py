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


class RecurrentMixer(nnx.Module):
    """Decode plumbing shared by the recurrent mixers (GDN, KDA, Mamba2).

    A subclass sets ``self.conv1d`` (a ``ShortConv``) and ``self.state_shape`` (the per-sequence float32 state,
    ``(HV, K, V)``) and implements ``_mix(x, conv, state=None, valid=None) -> (y [B,T,D], final state, conv tail)``,
    where ``conv(u) -> (conv output, tail)`` and padded steps (``~valid``) must leave the state alone. Each subclass
    defines its own ``__call__`` (``self._mix(x, self.plain_conv)[0]``): ``nnx.capture(..., method_outputs=...)``
    instruments only methods defined on the class itself, and the notebook captures every block's ``__call__``.
    """

    def plain_conv(self, u: jax.Array, segment_ids: jax.Array | None = None) -> tuple[jax.Array, None]:
        """The training-time short conv (zero history, no tail kept; ``segment_ids``: packed documents)."""
        return self.conv1d(u, segment_ids), None

    def init_cache(self, batch: int, max_len: int) -> RecurrentCache:
        """Zero state ``[B, *state_shape]`` float32 and conv tail ``[B, conv_size - 1, C]``; ``max_len`` unused."""
        return RecurrentCache(jnp.zeros((batch, *self.state_shape), jnp.float32), self.conv1d.init_tail(batch))

    def extend(self, x: jax.Array, n: jax.Array, pos: jax.Array, cache: RecurrentCache
               ) -> tuple[jax.Array, RecurrentCache]:
        """Continue from ``cache`` with ``x [B,T,D]`` of which the first ``n[b]`` steps are real. ``pos`` unused."""
        y, state, tail = self._mix(x, lambda u: self.conv1d.extend(u, cache.conv, n), cache.state,
                                   valid_steps(n, x.shape[1]))
        return y, RecurrentCache(state, tail)


def valid_steps(n: jax.Array, steps: int) -> jax.Array:
    """``[B, steps]`` bool: step ``t`` of row ``b`` is real when ``t < n[b]`` (right padding after it)."""
    return jnp.arange(steps)[None, :] < n[:, None]


def zero_padding(valid: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Each ``x [B,T,...]`` with its padded steps (``~valid [B,T]``) set to 0: pads then leave a recurrence alone."""
    return tuple(jnp.where(valid.reshape(*valid.shape, *(1,) * (x.ndim - 2)), x, 0).astype(x.dtype) for x in xs)


def recurrent_impl(impl: str, steps: int) -> str:
    """The kernel implementation for a chunk of ``steps`` tokens: the plain recurrence for a single decode step."""
    return "naive" if steps == 1 else impl


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
