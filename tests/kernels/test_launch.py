"""The launch forms (``kernels/recurrent/launch.py``): the levels launch's BlockSpecs over several chunks, and the
chunk-parallel launches looping over several chunks per program, with the same values and gradients."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest
from jax.experimental import pallas as pl

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.recurrent.launch import over_chunks
from hybrid_jax.kernels.tooling.calls import call
from tests.conftest import jaxpr_equations
from tests.kernels.conftest import PALLAS, make_inputs, problem, rel_rms, value_and_grads


def test_levels_launch_spans_chunks_on_axis_1_only():
    """The levels launch widens each chunk-parallel BlockSpec to several chunks along axis 1 (``C`` rows, or one
    squeezed per-chunk entry such as a state snapshot); a spec that follows the chunk on another axis is an error,
    not a silently wrong block."""
    rows = pl.BlockSpec((None, 16, None, 32), lambda b, h, c: (b, c, h // 2, 0))
    snap = pl.BlockSpec((None, None, None, 32, 64), lambda b, h, c: (b, c, h, 0, 0))
    assert over_chunks(rows, 4).block_shape == (None, 64, None, 32)
    assert over_chunks(snap, 4).block_shape == (None, 4, None, 32, 64)
    per_head_first = pl.BlockSpec((None, None, None, 32), lambda b, h, c: (b, h, c, 0))
    with pytest.raises(ValueError, match="axis 1"):
        over_chunks(per_head_first, 4)


def launch_grids(fn, *args) -> dict[str, tuple[int, ...]]:
    """The grid of each ``pallas_call`` in ``fn(*args)``'s jaxpr (nested ones included), by kernel name."""
    return {str(eqn.params["name"]): tuple(eqn.params["grid_mapping"].grid)
            for eqn in jaxpr_equations(jax.make_jaxpr(fn)(*args).jaxpr) if eqn.primitive.name == "pallas_call"}


@pytest.mark.parametrize("kind, T, split, options", [
    ("gdn", 120, None, {}), ("gla", 64, None, {}), ("kda", 96, 0, {}), ("kda", 64, None, {"output_in_state": True}),
], ids=["gdn-fused", "gla", "kda-split-six-chunks", "kda-fused-output-in-state"])
def test_chunks_per_program(kind, T, split, options):
    """``chunks_per_program=4``: each program of the chunk-parallel launches (``wy``, ``output``, ``grad``,
    ``grad_wy``) loops over 4 consecutive chunks of 16 (2 where there are 6), and values and gradients are the one-chunk
    programs' to float32 rounding (on the CPU XLA may round a loop's float32 sums differently). KDA: the gate falls
    by 100 at row 20, so that the levels launches redo a chunk too."""
    p = problem(kind, B=1, T=T, K=32, V=32)
    x, ct = make_inputs(p, 31)
    if kind == "kda":
        x = dict(x, g=x["g"].at[:, 20].add(-100.0))
    one = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), split_grad_from=split, **options)
    looped = dataclasses.replace(one, chunks_per_program=4, chunks_per_program_from=0)
    N = -(-T // 16)
    per_program = math.gcd(N, 4)

    def grids(config):
        loss = lambda x: call(p, x, PALLAS, config=config)[0].sum()  # noqa: E731
        return launch_grids(jax.grad(loss), x)

    chunk_parallel = {"wy_fwd", "output_fwd", "grad_bwd", "grad_wy_bwd"}
    one_grids, looped_grids = grids(one), grids(looped)
    assert set(one_grids) == set(looped_grids) and {"grad_bwd"} <= set(one_grids)
    assert ("grad_wy_bwd" in one_grids) == (split == 0)
    assert ("output_fwd" in one_grids) != options.get("output_in_state", False)
    for name, grid in one_grids.items():  # the chunk-parallel launches: N programs per head, then N / per_program
        want = grid[:2] + (N // per_program,) if name in chunk_parallel else grid
        heads = p.H if (name, kind) == ("grad_bwd", "gla") else p.HV  # GLA's gradient: one program per q/k head
        assert name not in chunk_parallel or grid[:3] == (1, heads, N), (name, grid)
        assert looped_grids[name] == want, (name, grid, looped_grids[name])
    assert len(looped_grids["grad_bwd"]) == 3
    expected, got = (jax.tree.leaves(value_and_grads(p, x, ct, config=c)) for c in (one, looped))
    assert len(got) == len(expected) == 2 + len(x)
    for a, b in zip(expected, got, strict=True):
        assert rel_rms(b, a) <= 1e-5, rel_rms(b, a)
