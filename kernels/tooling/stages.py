"""The recurrent kernels' launch stages one at a time: each stage's arguments at a problem, and its time alone under a
launch config (what a sweep scores a candidate by, and what ``benchmarks kernels`` reports per stage)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax.kernels import reference
from hybrid_jax.kernels.recurrent import Static
from hybrid_jax.kernels.recurrent.search import LEVELS_STAGES, STAGES, stage_inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.kernels.tuning import RecurrentConfig


def stage_args(p: Problem, config: RecurrentConfig, x: dict[str, jax.Array], do: jax.Array, *,
               interpret: bool = False, every: int | None = None) -> dict[str, tuple]:
    """The arguments of each stage (``search.STAGES[name](static, *args)``) at ``config.chunk`` on the inputs ``x``
    (``q, k [B,T,H,K]``, ``v [B,T,HV,V]``, ``g``, ``beta`` as :func:`inputs` gives them; T a multiple of the chunk,
    head dims powers of two >= 16) and the output's cotangent ``do [B,T,HV,V]``, from a zero initial state
    (``search.stage_inputs``); ``every``: packed documents of that many tokens."""
    rel = None
    if every is not None:
        segment_ids = jnp.broadcast_to(jnp.arange(p.T, dtype=jnp.int32) // every, (p.B, p.T))
        rel = reference.chunk_segments(segment_ids, config.chunk)
    static = Static(p.K**-0.5, config.chunk, config, interpret)
    q = reference.l2_normalize(x["q"]).astype(x["q"].dtype) if p.delta else x["q"]
    h0 = jnp.zeros((p.B, p.HV, p.K, p.V), jnp.float32)
    # called as it is (not jitted): some stages take a Python flag (``output``'s ``delta``) that must stay static
    return stage_inputs(static, q, x["k"], x["v"], x["g"], x.get("beta"), h0, do, rel)


def stage_ms(name: str, args: tuple, config: RecurrentConfig, repeats: int, interpret: bool = False, **kw) -> float:
    """Median ms of the stage ``name`` alone under ``config`` (arguments from :func:`stage_args` at its chunk;
    ``kw``: for the stage function, e.g. ``redo_far=False``). A config that does not compile raises."""
    static = Static(1.0, config.chunk, config, interpret)
    arrays = [i for i, a in enumerate(args) if not isinstance(a, bool)]  # a flag (``output``'s ``delta``) stays static

    def stage(*xs):
        full = list(args)
        for i, x in zip(arrays, xs, strict=True):
            full[i] = x
        return STAGES[name](static, *full, **kw)

    return median_ms(jax.jit(stage), *(args[i] for i in arrays), repeats=repeats)


def stage_times(p: Problem, config: RecurrentConfig, args: dict[str, tuple], repeats: int,
                interpret: bool = False) -> dict[str, float]:
    """Median ms of every stage of ``args`` (:func:`stage_args`) under ``config``, each timed alone. With a per-key
    gate and one-reference diagonal blocks, also ``NAME_first``: the stages of ``LEVELS_STAGES`` without their second
    (levels) launch, which is what that launch costs when, as on FLA-law inputs, no chunk needs it."""
    times = {n: stage_ms(n, a, config, repeats, interpret=interpret) for n, a in args.items()}
    if p.per_key and config.one_reference_span > 0:
        for n in LEVELS_STAGES:
            if n in args:
                times[f"{n}_first"] = stage_ms(n, args[n], config, repeats, interpret=interpret, redo_far=False)
    return times
