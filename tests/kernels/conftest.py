"""Shared helpers of the kernel tests, built on the kernel tooling (``kernels/tooling``): problems at small shapes,
their inputs with the models' gate law, stress gates on top, and the value-and-gradient check of the Pallas kernels
(interpret mode) against the token-by-token recurrence and the chunked XLA form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.kernels.tooling.calls import Config, Cotangents, fwd_bwd, reference_run
from hybrid_jax.kernels.tooling.errors import TOLERANCE, Tolerance, errors, over, rel_rms  # noqa: F401 (re-exported)
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem

PALLAS = "pallas_interpret"
MILD = (3e-3, 3e-2)  # a dt range of the model law where no gate falls by the one-reference span within a block


def problem(op: str = "gdn", *, B: int = 2, T: int = 37, H: int = 1, HV: int = 2, K: int = 16, V: int = 32,
            dtype: str = "float32", chunk: int = 16) -> Problem:
    """A small problem: by default one ragged sequence pair (T 37, chunks of 16), two value heads per q/k head."""
    return Problem(op, B, T, H, HV, K, V, dtype, chunk)


def make_inputs(p: Problem, seed: int, *, init: bool = True, dt_range: tuple[float, float] = (1e-3, 1e-1)
                ) -> tuple[dict[str, jax.Array], Cotangents]:
    """``(x, (do, dfinal))``: the problem's inputs (``tooling.inputs``, the models' gate law with ``dt_range``;
    ``init``: an initial state, and a final-state cotangent) and cotangents, both from ``seed``."""
    x = inputs(p, seed, initial_state=init, dt_range=dt_range)
    do, dfinal = cotangents(p, seed + 1000)
    return x, (do, dfinal if init else None)


def steep_gates(x: dict[str, jax.Array], g_min: float, seed: int, rows: slice = slice(None)) -> dict[str, jax.Array]:
    """``x`` with the gates of ``rows`` drawn from ``U(g_min, 0)`` and every third of those rows at ``g_min`` (a
    stress law on top of the model's: decays of ``exp(g_min)`` per step, chunk-level decays that underflow)."""
    g = np.asarray(x["g"]).copy()
    part = g[:, rows]
    steep = np.random.default_rng(seed).uniform(g_min, 0.0, part.shape).astype(np.float32)
    steep[:, ::3] = g_min
    g[:, rows] = steep
    return dict(x, g=jnp.asarray(g))


def segment_ids(T: int, starts: list[list[int]]) -> jax.Array:
    """``[len(starts), T]`` int32: row ``b``'s documents begin at ``starts[b]`` (besides position 0)."""
    seg = np.zeros((len(starts), T), np.int32)
    for b, row in enumerate(starts):
        for s in row:
            seg[b, s:] += 1
    return jnp.asarray(seg)


def check(p: Problem, x: dict, ct: Cotangents, *, config: Config | None = None,
          refs: tuple[str, ...] = ("naive", "xla"), tol: Tolerance | None = None, **options) -> None:
    """The Pallas kernels (interpret mode; ``config``: under this launch config) against each of ``refs`` in
    float32 (the token-by-token recurrence; the chunked XLA form at the problem's chunk): output in ``v``'s dtype and
    shape, final state (where ``ct`` has its cotangent), every input's gradient in its own dtype and shape and
    finite, each within ``tol`` (default ``TOLERANCE[p.dtype]``) in relative RMS. ``options``: ``segment_ids``,
    ``causal`` (``calls.call``)."""
    tol = tol or TOLERANCE[p.dtype]
    out, grads = jax.jit(fwd_bwd(p, PALLAS, config=config, **options))(x, ct)
    assert out[0].dtype == x["v"].dtype and out[0].shape == x["v"].shape
    assert set(grads) == set(x)
    for name, grad in grads.items():
        assert grad.shape == x[name].shape and grad.dtype == x[name].dtype, name
        assert np.all(np.isfinite(np.asarray(grad, np.float32))), name
    for ref in refs:
        ref_out, ref_grads = reference_run(p, ref, x, ct, **options)
        errs = errors(out, grads, ref_out, ref_grads)
        assert not over(errs, tol), (ref, errs)


def value_and_grads(p: Problem, x: dict, ct: Cotangents, *, impl: str = PALLAS, config: Config | None = None,
                    **options):
    """``((o, final or None), grads)`` of ``impl`` (jitted), for comparing two runs leaf by leaf."""
    return jax.jit(fwd_bwd(p, impl, config=config, **options))(x, ct)
