"""Sweep launch parameters of the recurrent kernels on a GPU and print an entry for ``kernels/tuning.py``.

    python -m benchmarks autotune [--shape gdn_anchor ...] [--budget-s 150] [--start chunk=64] [--fields grad ...]

Coordinate descent from the current table entry over the search space beside the kernels
(``kernels/recurrent/search.py``: the state passes' V tiles, then (num_warps, num_stages) of each launch), one axis at
a time, timing only the stages an axis changes (each candidate compiles one kernel). A candidate that fails to compile
(for example shared memory overflow on MI300X) is skipped with a note. Stops when the time budget is spent. With
several shapes, a candidate's score is the sum over shapes. Writes the record ``autotune`` (the winner and every
candidate's time).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks import record
from benchmarks.kernels import SHAPES, stage_args, stage_ms
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tuning import current_arch, override, recurrent_op


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks autotune", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["gdn_anchor"], choices=[s.name for s in SHAPES])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--start", default="", help="FIELD=VALUE[,...] changed in the table entry before the sweep "
                    "(e.g. chunk=64: tune the launches at another chunk; KERNEL.FIELD sets a launch's field)")
    ap.add_argument("--fields", nargs="+", help="sweep only these axes, in this order (default: all, in the "
                                                "search space's order)")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    shapes = [s for s in SHAPES if s.name in args.shape]
    op = OPS[recurrent_op(shapes[0].per_key, shapes[0].delta)]
    best = op.config()  # KDA shapes start from (and print) the KDA table
    best = override(best, args.start) if args.start else best
    axes = op.search_space(best, shapes)
    if args.fields:
        by_field = {a.field: a for a in axes}
        unknown = [f for f in args.fields if f not in by_field]
        if unknown:
            ap.error(f"--fields {unknown} are not in the search space at these shapes: {list(by_field)}")
        axes = [by_field[f] for f in args.fields]
    stage_inputs = [stage_args(s, best) for s in shapes]
    tried = []

    def measure(cfg, stages) -> float:
        try:
            return sum(stage_ms(n, a[n], cfg, args.repeats) for a in stage_inputs for n in stages if n in a)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
            print(f"  skip: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")

    print(f"{current_arch()} {args.shape}: start {best}", flush=True)
    for axis in axes:
        best_ms = measure(best, axis.stages)
        print(f"{axis.field}: {getattr(best, axis.field)} {best_ms:.3f} ms", flush=True)
        for value in axis.values:
            if time.perf_counter() - start > args.budget_s:
                break
            if getattr(best, axis.field) == value:
                continue
            cand = dataclasses.replace(best, **{axis.field: value})
            ms = measure(cand, axis.stages)
            tried.append({"field": axis.field, "value": repr(value), "ms": ms})
            print(f"  {value}: {ms:.3f} ms", flush=True)
            if ms < best_ms:
                best, best_ms = cand, ms
    print(f"done after {time.perf_counter() - start:.0f} s")
    print(f'    "{current_arch()}": {best!r},')
    record.save("autotune", {"shapes": args.shape, "arch": current_arch(), "best": repr(best), "tried": tried},
                out=args.out)


if __name__ == "__main__":
    main()
