"""The one error measure, relative RMS against a reference, and the tolerances that judge it.

Two levels, by the kernels' input dtype, each ``(forward, gradients)``: the output and the final state against the
first number, every input's gradient against the second.

- ``TOLERANCE``: the kernels' contract (design.md, Numerics), at small shapes against the token-by-token
  recurrence or the float32 XLA form (the tests, in interpret mode) and on the GPU at the benchmark shapes on
  FLA-law inputs (``benchmarks kernels``).
- ``AT_MODEL_SHAPES``: at a model's shapes (T up to 2048) with the model's gates, on any GPU (the doctor, the
  tuner's numerics check). bf16 forward 1e-2: the kernels multiply bf16 operands on the tensor cores as FLA's do,
  and at the published shapes their forward error sits near the contract's bound (benchmarks/NOTES.md, "Tolerances
  and input laws"); 1e-2 leaves room for other GPUs, not for a wrong launch (an error of order 1). float32:
  interpret mode and the XLA forms.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest relative RMS error of the forward values (output, final state) and of each gradient."""

    fwd: float
    grad: float

    def of(self, name: str) -> float:
        """The bound for the error named ``name`` (``o``, ``final_state``, or ``dNAME`` for a gradient)."""
        return self.fwd if name in ("o", "final_state") else self.grad


TOLERANCE = {"float32": Tolerance(1e-4, 1e-4), "bfloat16": Tolerance(5e-3, 2e-2)}
AT_MODEL_SHAPES = {"float32": Tolerance(1e-4, 1e-3), "bfloat16": Tolerance(1e-2, 2e-2)}


def rel_rms(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64 (the measure FLA's tests use); a zero ``ref`` counts as 1e-30."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def errors(out: tuple, grads: dict, ref_out: tuple, ref_grads: dict) -> dict[str, float]:
    """Relative RMS errors of ``out = (o, final state or None)`` and of ``grads`` (name -> gradient) against the
    reference's: keys ``o``, ``final_state`` (where there is one) and ``dNAME``; NaN or inf anywhere is inf."""
    errs = {"o": rel_rms(out[0], ref_out[0])}
    if out[1] is not None:
        errs["final_state"] = rel_rms(out[1], ref_out[1])
    errs.update({f"d{n}": rel_rms(grads[n], ref_grads[n]) for n in grads})
    return {n: (e if math.isfinite(e) else math.inf) for n, e in errs.items()}


def over(errs: dict[str, float], tol: Tolerance) -> list[str]:
    """``"NAME ERR > BOUND"`` for each error of ``errs`` over ``tol`` (or not finite); empty when all are within."""
    return [f"{n} {e:.1e} > {tol.of(n):g}" for n, e in errs.items() if not e <= tol.of(n)]
