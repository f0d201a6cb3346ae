"""Sweep launch parameters of the recurrent kernels on a GPU and print an entry for ``kernels/tuning.py``.

    python -m benchmarks.autotune [--shape gdn_anchor] [--budget-s 150]

Coordinate descent from the current table entry: ``block_v`` first, then (num_warps, num_stages) of each
kernel in turn, keeping the best forward+backward time so far. A candidate that fails to compile (for
example shared memory overflow on MI300X) is skipped. Stops early when the time budget is spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from benchmarks.kernels import SHAPES, inputs, make_fns, median_ms
from hybrid_jax.kernels.tuning import Launch, current_arch, recurrent_config

BLOCK_V = (32, 64, 128)
LAUNCHES = tuple(Launch(w, s) for w in (2, 4, 8) for s in (1, 2, 3))
KERNELS = ("wy", "state", "output", "state_bwd", "grad")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gdn_anchor", choices=[s.name for s in SHAPES])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    shape = next(s for s in SHAPES if s.name == args.shape)
    x = inputs(shape)
    do = jax.random.normal(jax.random.PRNGKey(1), (shape.B, shape.T, shape.HV, shape.V), jnp.bfloat16)
    start = time.perf_counter()

    def measure(cfg) -> float:
        try:
            return median_ms(make_fns(shape, "pallas", cfg)[1], x, do, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")

    best = recurrent_config()
    best_ms = measure(best)
    print(f"{current_arch()} {shape.name}: start {best_ms:.3f} ms  {best}", flush=True)
    fields = [("block_v", BLOCK_V)] + [(k, LAUNCHES) for k in KERNELS if shape.delta or k != "wy"]
    for field, values in fields:
        for value in values:
            if time.perf_counter() - start > args.budget_s:
                break
            if getattr(best, field) == value:
                continue
            cand = dataclasses.replace(best, **{field: value})
            ms = measure(cand)
            print(f"  {field}={value}: {ms:.3f} ms", flush=True)
            if ms < best_ms:
                best, best_ms = cand, ms
    print(f"best {best_ms:.3f} ms after {time.perf_counter() - start:.0f} s")
    print(f'    "{current_arch()}": {best!r},')


if __name__ == "__main__":
    main()
