"""Sweep launch parameters of the recurrent kernels on a GPU and print an entry for ``kernels/tuning.py``.

    python -m benchmarks.autotune [--shape gdn_anchor ...] [--budget-s 150] [--start chunk=64] [--fields grad ...]

Coordinate descent from the current table entry, one kernel stage at a time (each candidate compiles one kernel):
``block_v`` on the two sequential state passes, ``block_v_bwd`` on the reverse one, ``block_k`` on the gradient
pass, then (num_warps, num_stages) of each kernel (with a split gradient pass also of its second launch,
``grad_wy``). A candidate that fails to compile (for example shared memory overflow on MI300X) is skipped. Stops
early when the time budget is spent. With several shapes, a candidate's score is the sum over shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks.kernels import SHAPES, apply_variant, stage_args, stage_ms
from benchmarks.shapes import Shape
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig, current_arch, recurrent_config

BLOCK_V = (32, 64, 128)
BLOCK_V_BWD = (None, 16, 32, 64, 128)  # None: block_v
BLOCK_K = (None, 64, 32)  # None: the gradient pass over all of K
LAUNCHES = tuple(Launch(w, s) for w in (2, 4, 8) for s in (1, 2, 3))
FIELDS = ("block_v", "block_v_bwd", "block_k", "wy", "state", "output", "state_bwd", "grad", "grad_wy")


def sweep(cfg: RecurrentConfig, shapes: list[Shape], only: list[str] | None = None) -> list[tuple]:
    """``(field, candidate values, stages timed)`` in sweep order for ``cfg`` at ``shapes``; ``only``: these
    fields, in that order (``grad_wy`` only where some shape splits the gradient pass)."""
    fields = [("block_v", BLOCK_V, ("state", "state_bwd")), ("block_v_bwd", BLOCK_V_BWD, ("state_bwd",)),
              ("block_k", BLOCK_K, ("grad",))] + [
        (n, LAUNCHES, (n,)) for n in ("wy", "state", "output", "state_bwd", "grad")]
    if any(s.delta and cfg.split_grad_from is not None and s.K * s.V >= cfg.split_grad_from for s in shapes):
        # the split gradient pass's second launch (its WY part), timed in the "grad" stage
        fields.append(("grad_wy", LAUNCHES, ("grad",)))
    if only:
        by_name = {f[0]: f for f in fields}
        fields = [by_name[n] for n in only if n in by_name]
    return fields


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["gdn_anchor"], choices=[s.name for s in SHAPES])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--start", default="", help="FIELD=VALUE[,...] changed in the table entry before the sweep "
                    "(e.g. chunk=64: tune the launches at another chunk; KERNEL.FIELD sets a launch's field)")
    ap.add_argument("--fields", nargs="+", choices=FIELDS,
                    help="sweep only these fields, in this order (default: all, in the order above)")
    args = ap.parse_args()
    start = time.perf_counter()
    shapes = [s for s in SHAPES if s.name in args.shape]
    best = recurrent_config(per_key=shapes[0].per_key)  # KDA shapes start from (and print) the KDA table
    best = apply_variant(best, args.start) if args.start else best
    stage_inputs = [stage_args(s, best) for s in shapes]

    def measure(cfg, stages) -> float:
        try:
            return sum(stage_ms(n, a[n], cfg, args.repeats) for a in stage_inputs for n in stages if n in a)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
            print(f"  skip: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")

    print(f"{current_arch()} {args.shape}: start {best}", flush=True)
    for field, values, stages in sweep(best, shapes, args.fields):
        best_ms = measure(best, stages)
        print(f"{field}: {getattr(best, field)} {best_ms:.3f} ms", flush=True)
        for value in values:
            if time.perf_counter() - start > args.budget_s:
                break
            if getattr(best, field) == value:
                continue
            cand = dataclasses.replace(best, **{field: value})
            ms = measure(cand, stages)
            print(f"  {value}: {ms:.3f} ms", flush=True)
            if ms < best_ms:
                best, best_ms = cand, ms
    print(f"done after {time.perf_counter() - start:.0f} s")
    print(f'    "{current_arch()}": {best!r},')


if __name__ == "__main__":
    main()
