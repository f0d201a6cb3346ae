"""The row kernels' tiles (``rms_norm``, ``gated_norm``, ``l2_norm``): a program's tiles of whole rows of a ``[R, d]``
ref, loaded masked as float32 and stored back in the ref's dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32


def sweep_tiles(step: Callable, acc: Any, reads: tuple, *, n_rows: int, rows: int, per_program: int, width: int,
                d: int) -> Any:
    """Inside a row kernel over refs ``[R, d]``: this program's tiles ``p * per_program + i`` of ``rows`` rows, in
    turn, ``acc = step(tiles, store, acc)``; ``tiles`` holds the tile of each ref of ``reads`` as float32 ``[rows,
    width]`` (rows past ``n_rows`` and columns past ``d`` zero; ``width``: ``d`` padded to a power of two),
    ``store(ref, value)`` writes it in ``ref``'s dtype (masked alike). The next tile's reads are issued before this
    tile's arithmetic (held in their dtype): a program's loads do not wait for its reductions. Returns the last
    ``acc``."""
    cols = jnp.arange(width)
    col_in = cols < d
    first = pl.program_id(0) * per_program * rows  # read outside the loop (interpret mode)

    def place(it):
        at = first + it * rows + jnp.arange(rows)
        return (at[:, None], cols[None, :]), (at < n_rows)[:, None] & col_in[None, :]

    def load(it, in_program=None):
        where, mask = place(it)
        mask = mask if in_program is None else mask & in_program
        return tuple(pltriton.load(ref.at[where], mask=mask, other=0.0) for ref in reads)

    def run(it, tiles, acc):
        where, mask = place(it)

        def store(ref, value):
            pltriton.store(ref.at[where], value.astype(ref.dtype), mask=mask)

        return step(tuple(t.astype(F32) for t in tiles), store, acc)

    if per_program == 1:
        return run(0, load(0), acc)

    def tile(it, carry):
        acc, tiles = carry
        upcoming = load(it + 1, it + 1 < per_program)
        return run(it, tiles, acc), upcoming

    return jax.lax.fori_loop(0, per_program, tile, (acc, load(0)))[0]


def load_rows(ref, width: int) -> jax.Array:
    """All of a small ref ``[n, d]`` (a weight's rows) as float32 ``[n, width]``, columns past ``d`` zero."""
    n, d = ref.shape
    cols = jnp.arange(width)
    return pltriton.load(ref.at[jnp.arange(n)[:, None], cols[None, :]], mask=(cols < d)[None, :],
                         other=0.0).astype(F32)


def store_rows(ref, value: jax.Array) -> None:
    """``value [n, width]`` into all of ``ref [n, d]`` (columns past ``d`` dropped)."""
    n, d = ref.shape
    cols = jnp.arange(value.shape[1])
    pltriton.store(ref.at[jnp.arange(n)[:, None], cols[None, :]], value.astype(ref.dtype), mask=(cols < d)[None, :])
