"""The recurrent mixers' shared base (GDN, KDA, Mamba2): the short conv at training time, and the decode plumbing
that carries their state and conv tail in a :class:`~hybrid_jax.model.cache.RecurrentCache`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.model.cache import RecurrentCache
from hybrid_jax.model.layers import Heads
from hybrid_jax.parallel import recurrence, shards


class RecurrentMixer(nnx.Module):
    """Decode plumbing shared by the recurrent mixers (GDN, KDA, Mamba2).

    A subclass sets ``self.conv1d`` (a ``ShortConv``) and ``self.state_shape`` (the per-sequence float32 state,
    ``(HV, K, V)``) and implements ``_mix(x, conv, state=None, valid=None) -> (y [B,T,D], final state, conv tail)``,
    where ``conv(u, heads) -> (the conv output's pieces [B,T,h,d] by heads, tail)`` and padded steps (``~valid``)
    must leave the state alone. Each subclass defines its own ``__call__`` (``self._mix(x, self.plain_conv)[0]``):
    ``nnx.capture(..., method_outputs=...)`` instruments only methods defined on the class itself, and the notebook
    captures every block's ``__call__``.
    """

    def plain_conv(self, u: jax.Array, heads: Heads, segment_ids: jax.Array | None = None,
                   context: str | None = None) -> tuple[list[jax.Array], None]:
        """The training-time short conv (zero history, no tail kept; ``segment_ids``: packed documents; ``context``:
        the mesh axis the time axis is split over, inside its ``shard_map``), its output in pieces by ``heads``."""
        return self.conv1d(u, segment_ids, context, heads), None

    def init_cache(self, batch: int, max_len: int) -> RecurrentCache:
        """Zero state ``[B, *state_shape]`` float32 and conv tail ``[B, conv_size - 1, C]``; ``max_len`` unused."""
        return RecurrentCache(jnp.zeros((batch, *self.state_shape), jnp.float32), self.conv1d.init_tail(batch))

    def extend(self, x: jax.Array, n: jax.Array, pos: jax.Array, cache: RecurrentCache, start: jax.Array
               ) -> tuple[jax.Array, RecurrentCache]:
        """Continue from ``cache`` with ``x [B,T,D]`` of which the first ``n[b]`` steps are real. ``pos`` and
        ``start`` (positions, the document's first) unused: the state holds the current document only."""
        y, state, tail = self._mix(x, lambda u, heads: self.conv1d.extend(u, cache.conv, n, heads), cache.state,
                                   valid_steps(n, x.shape[1]))
        return y, RecurrentCache(state, tail)

    def context_prefill(self, x: jax.Array, segment_ids: jax.Array | None, max_len: int, context: str
                        ) -> tuple[jax.Array, RecurrentCache]:
        """This shard's ``x [B,T_local,D] -> (y [B,T_local,D], the cache after the whole sequence)`` inside a
        ``shard_map`` over ``context``: the final state (the whole sequence's, the same on every shard) and the last
        shard's last ``conv_size - 1`` conv inputs, those of an earlier document than the last token's set to 0 (as
        the one-device conv reads them). Decoding then continues the last document. ``max_len`` unused."""
        def conv(u: jax.Array, heads: Heads) -> tuple[list[jax.Array], jax.Array]:
            tail = u[:, u.shape[1] - self.conv1d.kernel.shape[0] + 1:]  # [B,K-1,C]
            if segment_ids is not None:
                same_doc = segment_ids[:, segment_ids.shape[1] - tail.shape[1]:] == segment_ids[:, -1:]
                tail = jnp.where(same_doc[..., None], tail, 0).astype(tail.dtype)
            return self.conv1d(u, segment_ids, context, heads), shards.from_last_shard(tail, context)

        y, state, tail = self._mix(x, conv, segment_ids=segment_ids, context=context)
        return y, RecurrentCache(state, tail)


def valid_steps(n: jax.Array, steps: int) -> jax.Array:
    """``[B, steps]`` bool: step ``t`` of row ``b`` is real when ``t < n[b]`` (right padding after it)."""
    return jnp.arange(steps)[None, :] < n[:, None]


def zero_padding(valid: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Each ``x [B,T,...]`` with its padded steps (``~valid [B,T]``) set to 0: pads then leave a recurrence alone."""
    return tuple(jnp.where(valid.reshape(*valid.shape, *(1,) * (x.ndim - 2)), x, 0).astype(x.dtype) for x in xs)


def sequence_form(kernel: Callable, context: str | None) -> Callable:
    """``kernel`` (``kernels.chunk_gated_delta_rule``, ``chunk_kda`` or ``chunk_simple_gla``) or, with the time axis
    split over the mesh axis ``context``, its context-parallel form (``hybrid_jax.parallel.recurrence``)."""
    if context is None:
        return kernel
    return functools.partial(getattr(recurrence, kernel.__name__), axis=context)


def recurrent_impl(impl: str, steps: int) -> str:
    """The kernel implementation for a chunk of ``steps`` tokens: the plain recurrence for a single decode step."""
    return "naive" if steps == 1 else impl
