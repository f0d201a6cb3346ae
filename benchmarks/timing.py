"""Wall-clock timing of jitted JAX calls and the result file's path, shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_ms(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 2) -> float:
    """Median wall time in ms of ``fn(*args)`` over ``repeats`` calls after ``warmup`` calls (compilation)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def result_path(explicit: str, name: str) -> str:
    """Where a benchmark writes its JSON: ``explicit`` (an ``--out`` flag) if given, else ``$OUT/name`` when ``OUT``
    is set, else ``""`` (print only)."""
    return explicit or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else "")
