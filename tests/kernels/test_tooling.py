"""The kernel tooling (``kernels/tooling``): the problem type, the input generator's laws, the error measure, the
timer and the coordinate-descent sweep's rules."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels.recurrent.search import Axis
from hybrid_jax.kernels.tooling import timing
from hybrid_jax.kernels.tooling.errors import AT_MODEL_SHAPES, TOLERANCE, errors, over, rel_rms
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.sweep import sweep
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig


def test_problem_names_keys_small_variants_and_specs():
    p = Problem("kda", 8, 2048, 16, 32, 100, 64)
    assert p.name == "kda H16/32 K100 V64" and p.delta and p.per_key and p.recurrent and p.key == ("kda", 128, 64)
    small = p.small()
    assert (small.B, small.T, small.H, small.HV, small.K, small.V) == (1, 37, 2, 4, 100, 64)
    assert small.name == "kda H2/4 K100 V64" and Problem("gla", 1, 8, 1, 1, 16, 16, name="x").small().name == "x"
    specs = p.small().specs(initial_state=True, segments=True)
    assert {n: (s.shape, str(s.dtype)) for n, s in specs.items()} == {
        "q": ((1, 37, 2, 100), "bfloat16"), "k": ((1, 37, 2, 100), "bfloat16"), "v": ((1, 37, 4, 64), "bfloat16"),
        "g": ((1, 37, 4, 100), "float32"), "beta": ((1, 37, 4), "bfloat16"),
        "initial_state": ((1, 4, 100, 64), "float32"), "segment_ids": ((1, 37), "int32")}
    assert set(Problem("attention", 1, 8, 2, 2, 48, 32).specs()) == {"q", "k", "v"}
    with pytest.raises(ValueError, match="op must be one of"):
        Problem("mamba", 1, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="multiple of H"):
        Problem("gdn", 1, 8, 2, 3, 16, 16)


@pytest.mark.parametrize("op", ["gdn", "kda", "gla", "attention"])
def test_inputs_follow_the_problem_and_the_law(op):
    """Shapes and dtypes of the problem; the model's gates (``-A softplus(a + dt_bias)``: negative, per head a decay
    from ``1e-3 * 1`` to ``0.1 * 16`` times ``softplus`` noise) or FLA's (``logsigmoid(N(0, 1)) / 16``, unit-norm
    keys); the same draw for the same seed."""
    p = Problem(op, 2, 64, 2, 2 if op == "attention" else 4, 16, 32, "bfloat16")
    x = inputs(p, 3)
    specs = p.specs(initial_state=op != "attention")
    assert {n: (a.shape, a.dtype) for n, a in x.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    assert all(np.array_equal(a, b) for a, b in zip(x.values(), inputs(p, 3).values(), strict=True))
    if op == "attention":
        return
    g = np.asarray(x["g"])
    assert g.max() < 0 and g.min() > -16 * 3  # A <= 16, softplus(a + dt_bias) < 3 for a ~ N(0, 1) < 5
    per_head = -g.reshape(-1, *g.shape[2:]).mean(0)  # the mean decay of each head (and key channel)
    assert per_head.max() / per_head.min() > 10  # heads with long and short memories
    fla = inputs(p, 3, law="fla", initial_state=False)
    assert "initial_state" not in fla and -1.0 < np.asarray(fla["g"]).min() and np.asarray(fla["g"]).max() < 0
    np.testing.assert_allclose(np.linalg.norm(np.asarray(fla["k"], np.float32), axis=-1), 1.0, atol=1e-2)
    do, dfinal = cotangents(p)
    assert do.shape == x["v"].shape and do.dtype == x["v"].dtype and dfinal.shape == x["initial_state"].shape


def test_errors_and_tolerances():
    ref = np.arange(1.0, 5.0)
    assert rel_rms(ref * 1.01, ref) == pytest.approx(0.01) and rel_rms(np.zeros(3), np.zeros(3)) == 0.0
    out, grads = (jnp.asarray(ref * 1.01), None), {"q": jnp.asarray([np.nan, 1.0])}
    errs = errors(out, grads, (jnp.asarray(ref), None), {"q": jnp.asarray([1.0, 1.0])})
    assert errs["o"] == pytest.approx(0.01) and errs["dq"] == math.inf and "final_state" not in errs
    assert over(errs, TOLERANCE["float32"]) == ["o 1.0e-02 > 0.0001", "dq inf > 0.0001"]
    assert over({"o": 4e-3, "dv": 1.9e-2}, TOLERANCE["bfloat16"]) == []
    assert AT_MODEL_SHAPES["bfloat16"].fwd == 1e-2 and AT_MODEL_SHAPES["float32"].grad == 1e-3


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

    ms = timing.median_ms(two_ms, jnp.ones(3), repeats=3, warmup=1, sample_ms=20.0)
    assert ms == pytest.approx(2.0)  # one call's time, not a sample's (20 ms)
    # one warm-up call, one call to size the samples, then 3 samples of 20 ms / 2 ms = 10 calls each
    assert len(calls) == 2 + 3 * 10


def test_median_ms_takes_the_median_sample_and_one_call_per_sample_when_a_call_outlasts_a_sample(clock):
    steps = iter([0.0, 0.050, 0.030, 0.090, 0.040])  # warm-up, sizing, then three samples of one call

    def slow(x):
        clock[0] += next(steps)
        return x + 1

    assert timing.median_ms(slow, jnp.ones(3), repeats=3, warmup=1, sample_ms=20.0) == pytest.approx(40.0)


@dataclasses.dataclass
class FakeSearch:
    """A search whose scores and checks are given: ``ms[(field, value)]``, ``bad``: the values that fail the check."""

    start: RecurrentConfig
    ms: dict
    bad: set
    tried: list = dataclasses.field(default_factory=list)
    checked: list = dataclasses.field(default_factory=list)

    def score(self, cfg, stages):
        if cfg.grad == Launch(8, 3):
            raise RuntimeError("out of resources: shared memory")
        return self.ms.get(("grad", cfg.grad), 1.0) + self.ms.get(("wy", cfg.wy), 1.0)

    def check(self, cfg):
        self.checked.append(cfg)
        return "rel RMS o 1.0e+00 > 0.01" if cfg.grad in self.bad else None


def test_sweep_keeps_the_fastest_candidate_whose_numerics_check():
    """Per axis from the best so far: a faster candidate whose values are off is rejected with a note, one that does
    not compile is skipped, the fastest checked one wins; the numerics of slower candidates are never computed."""
    fast_wrong, fast, slow = Launch(2, 1), Launch(4, 2), Launch(8, 1)
    search = FakeSearch(RecurrentConfig(), {("grad", fast_wrong): 0.1, ("grad", fast): 0.5, ("grad", slow): 2.0},
                        {fast_wrong})
    notes = []
    best = sweep(search, math.inf, notes.append, axes=[Axis("grad", (fast_wrong, slow, Launch(8, 3), fast), ("grad",))])
    assert best.grad == fast
    assert [t["outcome"] for t in search.tried] == ["rejected", "slower", "skipped", "won"]
    assert [c.grad for c in search.checked] == [fast_wrong, fast]
    assert notes == ["grad=Launch(num_warps=2, num_stages=1): 1.100 ms but rejected, rel RMS o 1.0e+00 > 0.01",
                     "grad=Launch(num_warps=8, num_stages=3): skipped, out of shared memory (RuntimeError: out of "
                     "resources: shared memory)"]
