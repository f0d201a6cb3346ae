"""benchmarks/timing.py: a sample times back-to-back calls and reports the time of one."""

import time

import jax.numpy as jnp

from benchmarks.timing import median_ms


def test_median_ms_divides_a_sample_of_back_to_back_calls_by_their_count():
    calls = []

    def two_ms(x):
        calls.append(time.perf_counter())
        time.sleep(0.002)
        return x + 1

    ms = median_ms(two_ms, jnp.ones(3), repeats=3, warmup=1, sample_ms=20.0)
    assert 1.9 <= ms <= 4.0, ms  # one call's time, not a sample's (about 20 ms)
    # one warm-up call, one call to size the samples, then 3 samples of 20 ms / (2 ms or more) <= 10 calls each
    assert 2 + 3 * 4 <= len(calls) <= 2 + 3 * 10, len(calls)
