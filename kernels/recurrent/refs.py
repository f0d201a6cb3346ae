"""Ref views: the one place where a kernel's ref is wrapped so that the kernel body need not know.

The kernels index their refs as the refs of one chunk (``x_ref[rows, :]``, ``x_ref[...]``). Three launch forms
change what such an index means, without a second copy of any kernel:

- :class:`ChunkOf`: a program that loops over several consecutive chunks (``RecurrentConfig.chunks_per_program``,
  and the levels launches) hands the kernel chunk ``r`` of refs that span all of them.
- :class:`FarRowsOnly`: the levels launch stores only the rows the one-reference launch got wrong.
- :class:`SummedGate` / :class:`ReverseSummedGrad`: where the kernels sum the raw gate themselves
  (``RecurrentConfig.gate_cumsum_in_kernels``), a load of the gate returns its chunk sums and a store of the gate's
  gradient writes the raw gate's (the reverse sums).
- :class:`HeadOf` / :class:`TileSum`: a program over one q/k head loops over the value heads that read it
  (``backward.grad`` without the delta rule): the kernel gets value head ``g`` of refs that span all of them, and
  its q/k gradient tiles are kept as values, summed over the heads before one store.

Each view supports only the indexing the kernels use, has the ``shape`` and ``dtype`` of the ref it stands for,
and emits the same loads and stores as the kernel on a plain ref would, plus its own arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hybrid_jax.kernels.recurrent.block_math import inclusive_sums


class ChunkOf:
    """Chunk ``r`` of a ref that spans several consecutive chunks on its first axis, indexed as the ref of one chunk:
    ``rows`` (a ``[R * C, ...]`` tile: rows ``r * C ...``) or not (a ``[R, ...]`` tile of per-chunk entries, such as
    state snapshots: entry ``r``). ``r`` may be traced."""

    def __init__(self, ref, r, C: int, rows: bool):
        self.ref, self.r, self.C, self.rows, self.dtype = ref, r, C, rows, ref.dtype
        self.shape = (C,) + tuple(ref.shape[1:]) if rows else tuple(ref.shape[1:])

    def _index(self, idx) -> tuple:
        idx = () if idx is Ellipsis else idx if isinstance(idx, tuple) else (idx,)
        if not self.rows:
            return (self.r,) + idx
        first = idx[0] if idx else slice(None)
        if isinstance(first, slice):  # the whole chunk (only ':' is used)
            return (pl.ds(self.r * self.C, self.C),) + idx[1:] + (slice(None),) * (len(self.shape) - max(len(idx), 1))
        return (pl.ds(self.r * self.C + first.start, first.size),) + idx[1:]

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, x):
        self.ref[self._index(idx)] = x


class FarRowsOnly:
    """An output ref whose row-block stores (``ref[pl.ds(i * SUB, SUB), ...] = x``) change only the rows that
    ``far[i]`` marks: the others keep what the ref holds (the one-reference launch's values, aliased)."""

    def __init__(self, ref, far: list[jax.Array]):
        self.ref, self.far, self.shape, self.dtype = ref, far, ref.shape, ref.dtype

    def __setitem__(self, idx, x):
        rows = idx[0]
        far = self.far[rows.start // rows.size]
        self.ref[idx] = jnp.where(far.reshape(far.shape + (1,) * (x.ndim - 1)), x.astype(self.dtype), self.ref[idx])


class SummedGate:
    """A ref of the raw gate read as the cumulated one: a load of a chunk's ``SUB`` rows returns their inclusive
    sums."""

    def __init__(self, ref):
        self.ref, self.shape, self.dtype = ref, ref.shape, ref.dtype

    def __getitem__(self, idx):
        return inclusive_sums(self.ref[idx], reverse=False)


class ReverseSummedGrad:
    """The gate-gradient output ref where the kernels sum the gate: a store of a chunk's ``d(gamma)`` rows writes the
    raw gate's gradient, their reverse inclusive sums."""

    def __init__(self, ref):
        self.ref, self.shape, self.dtype = ref, ref.shape, ref.dtype

    def __setitem__(self, idx, x):
        self.ref[idx] = inclusive_sums(x, reverse=True).astype(self.ref.dtype)


class HeadOf:
    """Value head ``g`` (may be traced) of a ref whose tile spans a q/k head's ``G`` value heads on axis ``axis``,
    indexed as the ref of one value head."""

    def __init__(self, ref, g: int | jax.Array, axis: int):
        self.ref, self.g, self.axis, self.dtype = ref, g, axis, ref.dtype
        self.shape = tuple(ref.shape[:axis]) + tuple(ref.shape[axis + 1:])

    def _index(self, idx) -> tuple:
        idx = () if idx is Ellipsis else idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (len(self.shape) - len(idx))
        return idx[:self.axis] + (self.g,) + idx[self.axis:]

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, x):
        self.ref[self._index(idx)] = x


class TileSum:
    """An output ref that the kernel stores once, the whole tile at a time: the stored value is kept, in float32, as
    :attr:`value` instead of written (a loop over value heads sums them)."""

    def __init__(self, ref):
        self.shape, self.dtype, self.value = ref.shape, jnp.float32, None

    def __setitem__(self, idx, x):
        if x.shape != self.shape or self.value is not None:
            raise ValueError(f"TileSum takes one store of the whole {self.shape} tile, got {x.shape}")
        self.value = x.astype(jnp.float32)
