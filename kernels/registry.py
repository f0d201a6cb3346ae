"""The ops: one entry each, the only map of op names in the tree.

An op's name (``gdn``, ``kda``, ``gla``, ``attention``) is what tuning files, problems
(:class:`hybrid_jax.kernels.tooling.problems.Problem`), the doctor and the tuner call it. Its entry holds the public
function of ``hybrid_jax.kernels`` that runs it, its gate kind, its implementations (what ``impl`` picks:
``kernels/api.py`` dispatches through them), its built-in config for an arch and shape, and its launch search space::

    op = OPS["kda"]
    cfg = op.config("sm90")                       # the built-in table entry
    axes = op.search_space(cfg, [problem])        # recurrent ops: [Axis]; attention: {kernel: [tiles]}
    o, final = op.implementations["pallas"](q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm=True,
                                            chunk_size=None, segment_ids=None)

Implementations of a recurrent op take ``(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size,
segment_ids)`` (``beta=None`` for ``gla``) and return ``(o [B,T,HV,V], final_state [B,HV,K,V] float32)``; those of
attention take ``(q, k, v, *, causal, scale, segment_ids, q_offset)`` and return ``o [B,Tq,H,Dv]``.
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
    """One op. ``function``: its public function in ``hybrid_jax.kernels``; ``delta``: the delta rule (takes
    ``beta``); ``per_key``: a decay per key channel (``g [B,T,HV,K]``); ``implementations``: impl name (as
    ``hybrid_jax.kernels``'s ``impl``, less ``auto``) -> function; ``config(arch=None, head_dim=...)``: the built-in
    table entry (arch None: the current device's); ``search_space(config, problems)``: what a sweep tries."""

    name: str
    function: str
    delta: bool
    per_key: bool
    implementations: dict[str, Callable]
    config: Callable[..., Any]
    search_space: Callable[..., Any]

    @property
    def recurrent(self) -> bool:
        """A chunked recurrence (GDN, KDA, GLA) rather than attention."""
        return self.name != "attention"


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


def _naive(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size, segment_ids):
    """The token-by-token recurrence (``chunk_size`` unused)."""
    return reference.naive_recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      use_qk_l2norm=use_qk_l2norm, segment_ids=segment_ids)


def _xla(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size, segment_ids):
    """The chunked pure-JAX form (``chunk_size=None``: 64)."""
    return reference.chunked_recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                        use_qk_l2norm=use_qk_l2norm,
                                        chunk_size=64 if chunk_size is None else chunk_size, segment_ids=segment_ids)


def _pallas(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size, segment_ids, interpret):
    """The Pallas kernels (``chunk_size=None``: the tuned chunk)."""
    return chunk_recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                            chunk_size=chunk_size, interpret=interpret, segment_ids=segment_ids)


def _attention_naive(q, k, v, *, causal, scale, segment_ids, q_offset):
    """The plain float32 softmax."""
    return reference.naive_attention(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids, q_offset=q_offset)


def _flash(q, k, v, *, causal, scale, segment_ids, interpret, q_offset):
    """The Pallas flash kernel."""
    return flash_attention(q, k, v, causal=causal, scale=scale, interpret=interpret, segment_ids=segment_ids,
                           q_offset=q_offset)


def _recurrent(name: str, function: str, delta: bool, per_key: bool) -> Op:
    return Op(name=name, function=function, delta=delta, per_key=per_key,
              implementations={"naive": _naive, "xla": _xla, "pallas": functools.partial(_pallas, interpret=False),
                               "pallas_interpret": functools.partial(_pallas, interpret=True)},
              config=lambda arch=None, dims=None, **_: tuning.recurrent_config(arch, per_key=per_key, op=name,
                                                                               dims=dims),
              search_space=recurrent_search_space)


OPS: dict[str, Op] = {
    "gdn": _recurrent("gdn", "chunk_gated_delta_rule", delta=True, per_key=False),
    "kda": _recurrent("kda", "chunk_kda", delta=True, per_key=True),
    "gla": _recurrent("gla", "chunk_simple_gla", delta=False, per_key=False),  # Mamba2's SSD: beta=None
    "attention": Op(
        name="attention", function="attention", delta=False, per_key=False,
        implementations={"naive": _attention_naive, "xla": _attention_naive,
                         "pallas": functools.partial(_flash, interpret=False),
                         "pallas_interpret": functools.partial(_flash, interpret=True)},
        config=lambda arch=None, head_dim=128: tuning.attention_config(arch, head_dim),
        search_space=lambda config=None, problems=(): ATTENTION_CANDIDATES,
    ),
}

IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "naive")


def recurrent_op(per_key: bool, delta: bool) -> str:
    """The name of the recurrent op with this gate kind: ``kda`` (per-key gate), ``gdn`` (delta rule), else ``gla``."""
    kind = (per_key, delta or per_key)
    return next(op.name for op in OPS.values() if op.recurrent and (op.per_key, op.delta) == kind)


def resolve_impl(impl: str, function: str, has_pallas: bool = True) -> str:
    """``impl`` checked against :data:`IMPLS` (a ``ValueError`` naming ``function`` otherwise), ``auto`` resolved:
    Pallas on a GPU where the function has it, else XLA."""
    if impl not in IMPLS:
        raise ValueError(f"{function}: impl must be one of {' | '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "pallas" if has_pallas and tuning.target_device().platform == "gpu" else "xla"
    return impl


def pallas_or_xla(impl: str, function: str) -> str:
    """The form a kernel with one Pallas and one XLA form runs for ``impl`` (the loss's softmax gradient, SwiGLU's
    backward, the short conv's backward): ``pallas``, ``pallas_interpret`` or ``xla`` (``naive``: the XLA form)."""
    impl = resolve_impl(impl, function)
    return "xla" if impl == "naive" else impl


def implementation(op: str, impl: str) -> Callable:
    """``OPS[op]``'s implementation for ``impl`` (``auto``: Pallas on a GPU, else XLA); a ``ValueError`` for an
    unknown impl, ``NotImplementedError`` for one the op does not have."""
    entry = OPS[op]
    impl = resolve_impl(impl, entry.function, "pallas" in entry.implementations)
    if impl not in entry.implementations:
        raise NotImplementedError(f"{entry.function}: impl={impl!r} is not available "
                                  f"(have {tuple(entry.implementations)})")
    return entry.implementations[impl]
