"""benchmarks/timing.py: a sample times back-to-back calls and reports the time of one."""

import jax.numpy as jnp
import pytest

from benchmarks import timing
from benchmarks.timing import median_ms


@pytest.fixture
def clock(monkeypatch):
    """A clock that moves only when a timed call advances it, so the counts below do not depend on machine load."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_median_ms_divides_a_sample_of_back_to_back_calls_by_their_count(clock):
    calls = []

    def two_ms(x):
        calls.append(clock[0])
        clock[0] += 0.002
        return x + 1

    ms = median_ms(two_ms, jnp.ones(3), repeats=3, warmup=1, sample_ms=20.0)
    assert ms == pytest.approx(2.0)  # one call's time, not a sample's (20 ms)
    # one warm-up call, one call to size the samples, then 3 samples of 20 ms / 2 ms = 10 calls each
    assert len(calls) == 2 + 3 * 10


def test_median_ms_takes_the_median_sample_and_one_call_per_sample_when_a_call_outlasts_a_sample(clock):
    steps = iter([0.0, 0.050, 0.030, 0.090, 0.040])  # warm-up, sizing, then three samples of one call

    def slow(x):
        clock[0] += next(steps)
        return x + 1

    assert median_ms(slow, jnp.ones(3), repeats=3, warmup=1, sample_ms=20.0) == pytest.approx(40.0)
