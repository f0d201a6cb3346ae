"""Sweep launch parameters of the recurrent kernels on a GPU at benchmark shapes and print an entry for
``kernels/tuning.py``.

    python -m benchmarks autotune [--shape gdn_anchor ...] [--budget-s 150] [--start chunk=64] [--fields grad ...]

The search of ``python -m hybrid_jax.tune`` (``kernels/tooling/sweep.py``): coordinate descent from the current table
entry over the search space beside the kernels (``kernels/recurrent/search.py``: the state passes' V tiles, then
(num_warps, num_stages) of each launch), one axis at a time, timing only the stages an axis changes (each candidate
compiles one kernel) on FLA-law inputs, a faster candidate kept only once its values and gradients match the float32
XLA form (on inputs with the model's gates). A candidate that fails to compile (for example shared memory overflow on
MI300X) is skipped with a note. Stops when the time budget is spent. With several shapes (of one op), a candidate's
score is the sum over shapes. Writes the record ``autotune`` (the winner and every candidate's time).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks import record
from benchmarks.shapes import SHAPES, by_name
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tooling.sweep import Search, sweep
from hybrid_jax.kernels.tuning import current_arch, override


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks autotune", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["gdn_anchor"], choices=[s.name for s in SHAPES])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--start", default="", help="FIELD=VALUE[,...] changed in the table entry before the sweep "
                    "(e.g. chunk=64: tune the launches at another chunk; KERNEL.FIELD sets a launch's field)")
    ap.add_argument("--fields", nargs="+", help="sweep only these axes, in this order (default: all, in the "
                                                "search space's order)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (checks the script on CPU)")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    shapes = by_name(args.shape)
    if len({s.op for s in shapes}) > 1:
        ap.error(f"--shape: one op at a time, got {sorted({s.op for s in shapes})}")
    if args.smoke:
        shapes = [dataclasses.replace(s.small(T=64), K=16, V=16) for s in shapes]
    op = OPS[shapes[0].op]
    begin = op.config(dims=shapes[0].key[1:])  # the table's entry for the op at these head dims
    begin = override(begin, args.start) if args.start else begin
    search = Search(shapes, begin, interpret=args.smoke, repeats=args.repeats)
    axes = search.axes()
    if args.fields:
        by_field = {a.field: a for a in axes}
        unknown = [f for f in args.fields if f not in by_field]
        if unknown:
            ap.error(f"--fields {unknown} are not in the search space at these shapes: {list(by_field)}")
        axes = [by_field[f] for f in args.fields]
    print(f"{current_arch()} {args.shape}: start {begin}", flush=True)
    best = sweep(search, start + args.budget_s, note=lambda text: print(f"  {text}", flush=True), axes=axes)
    for t in search.tried:
        print(f"  {t['field']}={t['value']}: {t['ms']:.3f} ms {t['outcome']}", flush=True)
    print(f"done after {time.perf_counter() - start:.0f} s")
    print(f'    "{current_arch()}": {best!r},')
    record.save("autotune", {"shapes": args.shape, "arch": current_arch(), "best": repr(best),
                             "tried": search.tried}, out=args.out)


if __name__ == "__main__":
    main()
