"""Where a shard sits on the context axis, and what it needs from the others: the previous shard's last tokens,
global positions, the whole sequence's segment ids. Inside a ``shard_map`` over ``axis`` with the time axis (axis 1
of ``[B, T, ...]`` arrays) split over it; shard ``i`` of ``n`` holds tokens ``[i T_local, (i+1) T_local)``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def shard_index(axis: str) -> jax.Array:
    """This shard's index ``i`` on ``axis`` (int32 scalar)."""
    return jax.lax.axis_index(axis)


def shard_count(axis: str) -> int:
    """The number of shards ``n`` on ``axis`` (static)."""
    return jax.lax.axis_size(axis)


def previous_tail(x: jax.Array, n: int, axis: str, fill: int | float = 0) -> jax.Array:
    """The previous shard's last ``n`` steps of ``x [B, T_local, ...]`` -> ``[B, n, ...]``; ``fill`` on shard 0
    (nothing precedes it). One ``ppermute`` from shard ``i`` to ``i + 1``."""
    if n > x.shape[1]:
        raise ValueError(f"context parallel: a shard of {x.shape[1]} steps is shorter than the {n} steps its next "
                         "shard needs from it (use fewer context shards or a longer sequence)")
    count = shard_count(axis)
    tail = jax.lax.ppermute(x[:, x.shape[1] - n:], axis, [(i, i + 1) for i in range(count - 1)])
    return jnp.where(shard_index(axis) == 0, jnp.asarray(fill, x.dtype), tail)


def global_positions(local_steps: int, axis: str) -> jax.Array:
    """``[T_local]`` int32: the global positions of this shard's tokens."""
    return shard_index(axis) * local_steps + jnp.arange(local_steps, dtype=jnp.int32)


def gather_time(x: jax.Array, axis: str) -> jax.Array:
    """``x [B, T_local, ...]`` of every shard, joined in order along time -> ``[B, T, ...]`` (an all-gather)."""
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def local_part(x: jax.Array, local_steps: int, axis: str) -> jax.Array:
    """This shard's ``[B, T_local, ...]`` part of a whole-sequence ``x [B, T, ...]``."""
    return jax.lax.dynamic_slice_in_dim(x, shard_index(axis) * local_steps, local_steps, axis=1)


def swap_mirror(x: Any, axis: str) -> Any:
    """Shard ``n-1-i``'s ``x`` (any pytree) on shard ``i`` (one ``ppermute`` per leaf; the middle shard of an odd
    ``n`` keeps its own). Its own inverse: what a shard computed for its mirror goes back with it."""
    count = shard_count(axis)
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, [(j, count - 1 - j) for j in range(count)]), x)


def from_last_shard(x: jax.Array, axis: str) -> jax.Array:
    """The last shard's ``x`` (any shape) on every shard of ``axis`` (one ``psum``, the other shards adding zeros)."""
    return jax.lax.psum(jnp.where(shard_index(axis) == shard_count(axis) - 1, x, jnp.zeros_like(x)), axis)


@dataclasses.dataclass(frozen=True)
class Shards:
    """The shards of ``axis`` as the recurrences' prefix exchanges with them (``kernels/recurrent/context.py``'s
    ``Exchange``; a benchmark stands in for it on one device): all-gathers, the index, a sum, the previous tail."""

    axis: str

    def gather(self, x: jax.Array) -> jax.Array:
        """Every shard's ``x``, ``[n, *x.shape]`` in shard order (an all-gather)."""
        return jax.lax.all_gather(x, self.axis)

    def index(self) -> jax.Array:
        """This shard's index."""
        return shard_index(self.axis)

    def total(self, x: jax.Array) -> jax.Array:
        """The sum of ``x`` over the shards (a ``psum``)."""
        return jax.lax.psum(x, self.axis)

    def previous_tail(self, x: jax.Array, n: int, fill: int | float = 0) -> jax.Array:
        """:func:`previous_tail` on this axis."""
        return previous_tail(x, n, self.axis, fill)
