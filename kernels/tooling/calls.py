"""Calling a problem's kernel: through the public function of ``hybrid_jax.kernels`` with an ``impl`` (looked up at
call time, so a test can patch it), or the Pallas op under a given launch config; its forward + backward; and the
value-and-gradient check against a float32 reference."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybrid_jax import kernels
from hybrid_jax.kernels.flash_attention import flash_attention
from hybrid_jax.kernels.recurrent import chunk_recurrence
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tooling.errors import errors
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tuning import AttentionConfig, RecurrentConfig

Cotangents = tuple[jax.Array, jax.Array | None]
Config = RecurrentConfig | AttentionConfig


def call(p: Problem, x: dict[str, jax.Array], impl: str, *, config: Config | None = None,
         segment_ids: jax.Array | None = None, causal: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """``(o [B,T,HV,V], final state [B,HV,K,V] float32, None for attention)`` of ``p``'s op on ``x`` (the names of
    :func:`inputs`; ``initial_state`` optional) with ``impl`` at the problem's chunk (0: the tuned one; the XLA form's
    64), q and k L2-normalised with the delta rule. ``config``: the Pallas kernels (``chunk_recurrence``,
    ``flash_attention``) under this launch config instead of the public function (``impl`` a Pallas one).
    ``segment_ids [B,T]``: packed documents; ``causal``: attention's mask."""
    chunk = p.chunk or None
    if config is not None:
        if not impl.startswith("pallas"):
            raise ValueError(f"call: a launch config is for the Pallas kernels, not {impl}")
        interpret = impl == "pallas_interpret"
        if not p.recurrent:
            return flash_attention(x["q"], x["k"], x["v"], causal=causal, scale=p.scale, config=config,
                                   interpret=interpret, segment_ids=segment_ids), None
        return chunk_recurrence(x["q"], x["k"], x["v"], x["g"], x.get("beta"), scale=p.scale,
                                initial_state=x.get("initial_state"), use_qk_l2norm=p.delta, chunk_size=chunk,
                                interpret=interpret, config=config, segment_ids=segment_ids)
    fn = getattr(kernels, OPS[p.op].function)
    if not p.recurrent:
        return fn(x["q"], x["k"], x["v"], causal=causal, scale=p.scale, impl=impl, segment_ids=segment_ids), None
    kw = dict(scale=p.scale, initial_state=x.get("initial_state"), output_final_state=True, chunk_size=chunk,
              impl=impl, segment_ids=segment_ids)
    if not p.delta:
        return fn(x["q"], x["k"], x["v"], x["g"], **kw)
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=True, **kw)


def fwd_bwd(p: Problem, impl: str, **options
            ) -> Callable[[dict, Cotangents], tuple[tuple[jax.Array, jax.Array | None], dict[str, jax.Array]]]:
    """``(x, (do, dfinal)) -> ((o, final state or None), {name: gradient of every input of x})`` of :func:`call`
    with ``options`` (``config``, ``segment_ids``, ``causal``), to jit. ``dfinal`` None: ``o`` alone is
    differentiated (the final state is not an output)."""
    def run(x: dict, ct: Cotangents):
        do, dfinal = ct
        if dfinal is None:
            o, vjp = jax.vjp(lambda x: call(p, x, impl, **options)[0], x)
            return (o, None), vjp(do.astype(o.dtype))[0]
        out, vjp = jax.vjp(lambda x: call(p, x, impl, **options), x)
        return out, vjp((do.astype(out[0].dtype), dfinal))[0]

    return run


def as_float32(tree):
    """Every array of ``tree`` in float32 (integers, e.g. segment ids, kept)."""
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def reference_run(p: Problem, reference: str, x: dict, ct: Cotangents, **options):
    """:func:`fwd_bwd` of ``reference`` (``naive`` or ``xla``; ``options`` as there, less ``config``) on ``x`` and
    ``ct`` in float32 at the highest matmul precision (the default lets float32 dots use TF32 on NVIDIA GPUs)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(fwd_bwd(p, reference, **options))(as_float32(x), as_float32(ct))


def errors_against(p: Problem, impl: str, reference: str, x: dict, ct: Cotangents, *, fn: Callable | None = None,
                   config: Config | None = None, **options) -> dict[str, float]:
    """Relative RMS errors (``errors.errors``) of ``impl``'s values and every input's gradient (``fn``: its jitted
    :func:`fwd_bwd`, if already built; ``config``: a launch config) against ``reference`` in float32, on ``x`` with
    cotangents ``ct`` (``options``: ``segment_ids``, ``causal``)."""
    out, grads = (fn or jax.jit(fwd_bwd(p, impl, config=config, **options)))(x, ct)
    ref_out, ref_grads = reference_run(p, reference, x, ct, **options)
    return errors(out, grads, ref_out, ref_grads)
