"""One entry per op: its implementations, its built-in config for an arch and shape, and its launch search space.

Anything that sweeps or checks launches (``benchmarks/autotune.py``, ``benchmarks/attention.py``, a tuner on the
user's GPU) starts here instead of keeping its own field lists::

    op = OPS["kda"]
    cfg = op.config("sm90")                  # the built-in table entry
    axes = op.search_space(cfg, [shape])     # what to sweep (recurrent ops: [Axis]; attention: {kernel: [tiles]})
    o, _ = op.implementations["pallas"](q, k, v, g, beta)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from hybrid_jax.kernels import reference, tuning
from hybrid_jax.kernels.flash_attention import flash_attention
from hybrid_jax.kernels.recurrent import chunk_recurrence
from hybrid_jax.kernels.recurrent.search import search_space as recurrent_search_space
from hybrid_jax.kernels.tuning import AttentionKernel, Launch


@dataclasses.dataclass(frozen=True)
class Op:
    """``implementations``: impl name (as ``hybrid_jax.kernels``'s ``impl``) -> function; ``config(arch=None,
    head_dim=...)``: the built-in table entry (arch None: the current device's); ``search_space(config, problems)``:
    the candidates a sweep tries from ``config``."""

    name: str
    implementations: dict[str, Callable]
    config: Callable[..., Any]
    search_space: Callable[..., Any]


# Flash attention: tiles to try per kernel (block_q, block_k, Launch(warps, stages)).
ATTENTION_CANDIDATES: dict[str, list[AttentionKernel]] = {
    "fwd": [AttentionKernel(128, 64, Launch(4, 3)), AttentionKernel(128, 64, Launch(8, 3)),
            AttentionKernel(128, 128, Launch(8, 3)), AttentionKernel(128, 128, Launch(4, 3)),
            AttentionKernel(64, 64, Launch(4, 3))],
    "dkdv": [AttentionKernel(64, 128, Launch(8, 2)), AttentionKernel(32, 128, Launch(4, 3)),
             AttentionKernel(64, 64, Launch(4, 3)), AttentionKernel(32, 64, Launch(4, 2)),
             AttentionKernel(64, 64, Launch(8, 2))],
    "dq": [AttentionKernel(128, 64, Launch(8, 2)), AttentionKernel(128, 32, Launch(4, 3)),
           AttentionKernel(64, 64, Launch(4, 3)), AttentionKernel(64, 32, Launch(4, 2))],
}


def _recurrent(name: str, per_key: bool) -> Op:
    return Op(
        name=name,
        implementations={"naive": reference.naive_recurrence, "xla": reference.chunked_recurrence,
                         "pallas": chunk_recurrence,
                         "pallas_interpret": functools.partial(chunk_recurrence, interpret=True)},
        config=lambda arch=None, **_: tuning.recurrent_config(arch, per_key=per_key),
        search_space=recurrent_search_space,
    )


OPS: dict[str, Op] = {
    "gdn": _recurrent("gdn", per_key=False),  # chunk_gated_delta_rule
    "kda": _recurrent("kda", per_key=True),  # chunk_kda
    "gla": _recurrent("gla", per_key=False),  # chunk_simple_gla (Mamba2 SSD): beta=None
    "attention": Op(
        name="attention",
        implementations={"naive": reference.naive_attention, "xla": reference.naive_attention,
                         "pallas": flash_attention,
                         "pallas_interpret": functools.partial(flash_attention, interpret=True)},
        config=lambda arch=None, head_dim=128: tuning.attention_config(arch, head_dim),
        search_space=lambda config=None, problems=(): ATTENTION_CANDIDATES,
    ),
}
