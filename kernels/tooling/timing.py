"""The one timer: wall-clock time of jitted JAX calls, for the doctor, the tuner and the benchmarks.

A sample is many back-to-back calls: a kernel of a millisecond or less is then timed with the device kept busy, not
with the host's dispatch and an idle gap before each call (benchmarks/NOTES.md, Timing method).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

ISSUE_CALLS = 8  # the host's issue time per call is taken over the first calls of a sample


def back_to_back_ms(fn: Callable[..., Any], arg_sets: list[tuple], repeats: int, calls: int,
                    warmup: int = 2) -> tuple[float, float]:
    """Median over ``repeats`` samples of the time per call (ms) of ``calls`` back-to-back calls of ``fn`` that cycle
    through ``arg_sets``, after ``warmup`` calls; and the median host time to issue one call (ms), from the first
    ``ISSUE_CALLS`` calls of a sample (later ones may wait for the runtime's queue of calls in flight). Only the last
    call's outputs are kept, so memory holds one call's."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    n_issue = min(calls, ISSUE_CALLS)
    total, issue = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
            if i == n_issue - 1:
                issue.append((time.perf_counter() - t0) / n_issue)
        jax.block_until_ready(out)  # the calls run in order on the device: the last one ends the sample
        total.append((time.perf_counter() - t0) / calls)
    return 1e3 * statistics.median(total), 1e3 * statistics.median(issue)


def median_ms(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 2, sample_ms: float = 20.0) -> float:
    """Median time in ms of one ``fn(*args)`` call over ``repeats`` samples after ``warmup`` calls (compilation).

    A sample is as many back-to-back calls as take about ``sample_ms`` (at least one; :func:`back_to_back_ms`)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, round(sample_ms / max(1e3 * (time.perf_counter() - t0), 1e-3)))
    return back_to_back_ms(fn, [args], repeats, calls, warmup=0)[0]

