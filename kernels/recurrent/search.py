"""The launch search space of the recurrent kernels, and each launch stage's inputs, for sweeping launches on a GPU.

The one sweep (``kernels/tooling/sweep.py``: ``python -m hybrid_jax.tune``, ``python -m benchmarks autotune``) walks
the :class:`Axis` list of :func:`search_space` by coordinate descent from a table entry, timing only the stages an
axis changes, each stage alone on the inputs :func:`stage_inputs` builds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from hybrid_jax.kernels.recurrent.backward import Residuals, grad, state_bwd
from hybrid_jax.kernels.recurrent.forward import output, state_fwd, wy
from hybrid_jax.kernels.recurrent.launch import Static
from hybrid_jax.kernels.recurrent.op import kernel_gate
from hybrid_jax.kernels.recurrent.segments import sequential_qk
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig

if TYPE_CHECKING:  # the tooling's problems import the op table, which imports this module
    from hybrid_jax.kernels.tooling.problems import Problem

LAUNCHES = tuple(Launch(w, s) for w in (2, 4, 8) for s in (1, 2, 3))
STAGES = {"wy": wy, "state": state_fwd, "output": output, "state_bwd": state_bwd, "grad": grad}
# stages with diagonal row blocks: with a per-key gate a first launch around one reference row per block, then one
# that redoes the rows it got wrong (launch.diagonal_launches), whose programs exit unless their chunk has such rows
LEVELS_STAGES = ("wy", "output", "grad")


@dataclasses.dataclass(frozen=True)
class Axis:
    """One coordinate of the search: the ``RecurrentConfig`` field ``field`` takes each of ``values``; ``stages``
    (keys of :data:`STAGES`) are the launches it changes, the ones to time when comparing values."""

    field: str
    values: tuple
    stages: tuple[str, ...]


def search_space(cfg: RecurrentConfig, problems: list[Problem]) -> list[Axis]:
    """The axes to sweep from ``cfg`` at ``problems``, in sweep order: the state passes' V tiles, then (warps, stages)
    of each launch; the split gradient pass's second launch only where some problem splits it."""
    axes = [Axis("block_v", (32, 64, 128), ("state", "state_bwd")),
            Axis("block_v_bwd", (None, 16, 32, 64, 128), ("state_bwd",))]  # None: block_v
    axes += [Axis(name, LAUNCHES, (name,)) for name in ("wy", "state", "output", "state_bwd", "grad")]
    if any(p.delta and cfg.splits_grad(p.K, p.V) for p in problems):
        axes.append(Axis("grad_wy", LAUNCHES, ("grad",)))  # timed in the "grad" stage
    return axes


def stage_inputs(static: Static, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array | None,
                 h0: jax.Array, do: jax.Array, rel: jax.Array | None = None) -> dict[str, tuple]:
    """The arguments of each stage (``STAGES[name](static, *args)``) on these inputs (T a multiple of the chunk, head
    dims powers of two >= 16, ``q`` and ``k`` as the kernels take them), computed by running the stages before it.
    With ``output_in_state`` at these dims (delta rule) ``wy`` also takes ``q``, ``state`` also ``q`` and ``P``, and
    there is no ``output`` stage. ``rel [B,T]``: packed documents (``reference.chunk_segments``), passed to every stage
    (the state passes then take ``q`` and ``k`` masked, ``segments.sequential_qk``, as the op does)."""
    gamma = kernel_gate(g.astype(jnp.float32), static.chunk, static.cfg)
    output_in_state = beta is not None and static.cfg.output_in_state_at(k.shape[-1], v.shape[-1])
    q_in_state = q if output_in_state else None
    q_seq, k_seq = sequential_qk(q, k, rel, static.chunk)
    args = {}
    u, w, t, p = v, None, None, None
    if beta is not None:
        args["wy"] = (k, v, gamma, beta, q_in_state, rel)
        u, w, t, *p_wy = wy(static, *args["wy"])
        p = p_wy[0] if output_in_state else None
    args["state"] = (k_seq, gamma, w, u, h0, q_seq if output_in_state else None, p, rel)  # p: from wy, or None
    h, v_new, *_ = state_fwd(static, *args["state"])
    if not output_in_state:
        args["output"] = (q, k, v_new, gamma, h, rel, beta is not None)
        _, p = output(static, *args["output"])
    res = Residuals(q, k, v, gamma, beta, w, t, h, v_new, p, rel, q_seq, k_seq)
    args["state_bwd"] = (res, do, h0)
    dh, dv_new, _, hdh = state_bwd(static, *args["state_bwd"])
    args["grad"] = (res, dh, hdh, dv_new if beta is not None else None, do)
    return args
