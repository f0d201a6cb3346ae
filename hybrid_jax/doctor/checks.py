"""One kernel problem on this device: does it lower and run, do its values and the gradients of every input match the
float32 chunked XLA form (at the problem's shapes) and the token-by-token recurrence (at a small ragged shape), and how
fast are its forward and forward + backward against the XLA form on the same inputs."""

from __future__ import annotations

import jax

from hybrid_jax.kernels.tooling.calls import call, errors_against, fwd_bwd
from hybrid_jax.kernels.tooling.errors import AT_MODEL_SHAPES, over
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.timing import median_ms


def _short(e: BaseException, n: int = 240) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:n]


def _compare(p: Problem, impl: str, reference: str, fn=None) -> tuple[dict[str, float], list[str]]:
    """``(errors, what is over the tolerance)`` of ``impl`` (``fn``: its jitted ``fwd_bwd``) against ``reference``
    (float32 inputs, highest matmul precision) on the problem's inputs (``errors.AT_MODEL_SHAPES``)."""
    errs = errors_against(p, impl, reference, inputs(p), cotangents(p), fn=fn)
    return errs, over(errs, AT_MODEL_SHAPES[p.dtype])


def _speed(p: Problem, impl: str, repeats: int) -> dict[str, float]:
    """Median ms of the forward and the forward + backward of ``impl`` and of the XLA form, same inputs."""
    x, ct = inputs(p), cotangents(p)
    out = {}
    for name in (impl, "xla"):
        fwd = jax.jit(lambda x, name=name: call(p, x, name))
        out[f"{name}_fwd_ms"] = median_ms(fwd, x, repeats=repeats)
        out[f"{name}_fwd_bwd_ms"] = median_ms(jax.jit(fwd_bwd(p, name)), x, ct, repeats=repeats)
    out["fwd_speedup"] = out["xla_fwd_ms"] / out[f"{impl}_fwd_ms"]
    out["fwd_bwd_speedup"] = out["xla_fwd_bwd_ms"] / out[f"{impl}_fwd_bwd_ms"]
    return {k: round(v, 4) for k, v in out.items()}


def check(p: Problem, impl: str, *, speed: bool, repeats: int = 10, small_T: int = 37) -> dict:
    """Every check of one problem with ``impl`` (``pallas``, ``pallas_interpret``, or ``auto`` for the attention that
    ``auto`` picks): a JSON-able dict with ``ok`` and, where not ok, ``failures`` (one line each)."""
    res = dict(kernel=p.name, op=p.op, impl=impl, shape=p.shape, chunk=p.chunk or "tuned",
               lowers=False, runs=False, ok=False, failures=[])
    x, ct = inputs(p), cotangents(p)
    try:
        compiled = jax.jit(fwd_bwd(p, impl)).lower(x, ct).compile()
        res["lowers"] = True
        jax.block_until_ready(compiled(x, ct))
        res["runs"] = True
    except Exception as e:  # noqa: BLE001 - said in the report, never a crash
        res["failures"].append(f"does not {'run' if res['lowers'] else 'lower'}: {_short(e)}")
        return res
    del x, ct
    res["errors_xla"], bad = _compare(p, impl, "xla", compiled)
    res["failures"] += [f"vs the float32 XLA form at {p.shape}: {b}" for b in bad]
    small = p.small(small_T)
    try:  # a problem already as small (interpret mode) shares the compiled kernel
        res["errors_naive"], bad = _compare(small, impl, "naive", compiled if small == p else None)
        res["failures"] += [f"vs the token-by-token recurrence at {small.shape}: {b}" for b in bad]
    except Exception as e:  # noqa: BLE001
        res["failures"].append(f"does not run at {small.shape}: {_short(e)}")
    if speed and not res["failures"]:
        try:
            res["speed"] = _speed(p, impl, repeats)
        except Exception as e:  # noqa: BLE001
            res["failures"].append(f"timing failed: {_short(e)}")
    res["ok"] = not res["failures"]
    return res
