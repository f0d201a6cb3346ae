"""One kernel case on this device: does it lower and run, do its values and the gradients of every input match the
float32 chunked XLA form (at the case's shapes) and the token-by-token recurrence (at a small ragged shape), and how
fast are its forward and forward + backward against the XLA form on the same inputs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.doctor.cases import call, inputs
from hybrid_jax.model.kernel_calls import Case
from hybrid_jax.tune.sweep import TOLERANCE, median_ms, rel_rms


def _short(e: BaseException, n: int = 240) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:n]


def _fwd_bwd(case: Case, impl: str):
    """``(x, cotangents) -> ((o, final state), gradients of every input)`` of the case's kernel with ``impl``."""
    def fwd_bwd(x, ct):
        out, vjp = jax.vjp(lambda x: call(case, x, impl), x)
        return out, vjp(ct)[0]
    return fwd_bwd


def _cotangents(case: Case, x, seed: int = 1):
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.standard_normal((case.B, case.T, case.HV, case.V), np.float32), x["v"].dtype)
    if case.op == "attention":
        return do, None
    return do, jnp.asarray(rng.standard_normal((case.B, case.HV, case.K, case.V), np.float32))


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def _errors(out, grads, ref_out, ref_grads) -> dict[str, float]:
    """rel RMS of the output, the final state and the gradient of every input; NaN/inf anywhere is inf."""
    errs = {"o": rel_rms(out[0], ref_out[0])}
    if out[1] is not None:
        errs["final_state"] = rel_rms(out[1], ref_out[1])
    errs.update({f"d{n}": rel_rms(grads[n], ref_grads[n]) for n in grads})
    return {n: (e if math.isfinite(e) else math.inf) for n, e in errs.items()}


def _compare(case: Case, impl: str, reference: str, fn=None) -> tuple[dict[str, float], list[str]]:
    """``(errors, what is over the tolerance)`` of ``impl`` (``fn``: its jitted fwd_bwd) against ``reference``
    (float32 inputs, highest matmul precision) on the case's inputs."""
    x = inputs(case)
    ct = _cotangents(case, x)
    out, grads = (fn or jax.jit(_fwd_bwd(case, impl)))(x, ct)
    with jax.default_matmul_precision("highest"):
        ref_out, ref_grads = jax.jit(_fwd_bwd(case, reference))(_f32(x), _f32(ct))
    errs = _errors(out, grads, ref_out, ref_grads)
    tol_o, tol_g = TOLERANCE[case.dtype]
    bad = [f"{n} {e:.1e} > {tol_o if n in ('o', 'final_state') else tol_g:g}" for n, e in errs.items()
           if not e <= (tol_o if n in ("o", "final_state") else tol_g)]
    return errs, bad


def _speed(case: Case, impl: str, repeats: int) -> dict[str, float]:
    """Median ms of the forward and the forward + backward of ``impl`` and of the XLA form, same inputs."""
    x = inputs(case)
    ct = _cotangents(case, x)
    out = {}
    for name in (impl, "xla"):
        fwd = jax.jit(lambda x, name=name: call(case, x, name))
        out[f"{name}_fwd_ms"] = median_ms(fwd, x, repeats=repeats)
        out[f"{name}_fwd_bwd_ms"] = median_ms(jax.jit(_fwd_bwd(case, name)), x, ct, repeats=repeats)
    out["fwd_speedup"] = out["xla_fwd_ms"] / out[f"{impl}_fwd_ms"]
    out["fwd_bwd_speedup"] = out["xla_fwd_bwd_ms"] / out[f"{impl}_fwd_bwd_ms"]
    return {k: round(v, 4) for k, v in out.items()}


def check(case: Case, impl: str, *, speed: bool, repeats: int = 10, small_T: int = 37) -> dict:
    """Every check of one case with ``impl`` (``pallas``, ``pallas_interpret``, or ``auto`` for the attention that
    ``auto`` picks): a JSON-able dict with ``ok`` and, where not ok, ``failures`` (one line each)."""
    res = dict(kernel=case.name, op=case.op, impl=impl, shape=case.shape, chunk=case.chunk or "tuned",
               lowers=False, runs=False, ok=False, failures=[])
    x = inputs(case)
    ct = _cotangents(case, x)
    try:
        compiled = jax.jit(_fwd_bwd(case, impl)).lower(x, ct).compile()
        res["lowers"] = True
        jax.block_until_ready(compiled(x, ct))
        res["runs"] = True
    except Exception as e:  # noqa: BLE001 - said in the report, never a crash
        res["failures"].append(f"does not {'run' if res['lowers'] else 'lower'}: {_short(e)}")
        return res
    del x, ct
    res["errors_xla"], bad = _compare(case, impl, "xla", compiled)
    res["failures"] += [f"vs the float32 XLA form at {case.shape}: {b}" for b in bad]
    small = case.small(small_T)
    try:  # a case already as small (interpret mode) shares the compiled kernel
        res["errors_naive"], bad = _compare(small, impl, "naive", compiled if small == case else None)
        res["failures"] += [f"vs the token-by-token recurrence at {small.shape}: {b}" for b in bad]
    except Exception as e:  # noqa: BLE001
        res["failures"].append(f"does not run at {small.shape}: {_short(e)}")
    if speed and not res["failures"]:
        try:
            res["speed"] = _speed(case, impl, repeats)
        except Exception as e:  # noqa: BLE001
            res["failures"].append(f"timing failed: {_short(e)}")
    res["ok"] = not res["failures"]
    return res
