"""Wall-clock timing of jitted JAX calls and the result file's path, shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_ms(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 2, sample_ms: float = 20.0) -> float:
    """Median time in ms of one ``fn(*args)`` call over ``repeats`` samples after ``warmup`` calls (compilation).

    A sample is the wall time of as many back-to-back calls as take about ``sample_ms`` (at least one), divided by
    their count: a call of a millisecond or less is then timed with the GPU kept busy, not with the host's dispatch
    and an idle gap before each call (one call per sample moved the same kernels' times by up to 50% on an H200).
    Only the last call's outputs are kept, so memory holds one call's."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, round(sample_ms / (1e3 * (time.perf_counter() - t0))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)  # the calls run in order on the device: the last one ends the sample
        times.append((time.perf_counter() - t0) / calls)
    return 1e3 * statistics.median(times)


def result_path(explicit: str, name: str) -> str:
    """Where a benchmark writes its JSON: ``explicit`` (an ``--out`` flag) if given, else ``$OUT/name`` when ``OUT``
    is set, else ``""`` (print only)."""
    return explicit or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else "")
