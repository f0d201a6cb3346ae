"""Learning-rate schedules at their phase boundaries, and what a resumed run's changed schedule does: the rule is
printed, a longer WSD run continues its stable phase exactly, a WSD run whose decay has begun is not re-timed."""

import math

import numpy as np
import pytest

from hybrid_jax.checkpoints import ConfigChangeRefused
from hybrid_jax.train.config_checks import ConfigError, check_config
from hybrid_jax.train.preflight import preflight
from hybrid_jax.train.step.schedule import (
    DECAY_SHAPES,
    continuation_note,
    decay_start,
    learning_rate_schedule,
    lr_at,
)
from tests.train.common import run_config, tiny_config

LR, MIN_LR = 1e-3, 1e-4


def _train(**overrides):
    """The tiny config's train section as a 1000-step WSD run (warmup 100, decay 200), checked."""
    config = tiny_config(**{**dict(steps=1000, warmup_steps=100, lr=LR, min_lr=MIN_LR, lr_schedule="wsd",
                                   decay_fraction=0.2), **overrides})
    check_config(config, 1)
    return config.train


# the share of lr - min_lr left a quarter into the decay, by shape
QUARTER = {"linear": 0.75, "cosine": 0.5 * (1 + math.cos(math.pi / 4)), "1-sqrt": 0.5}


@pytest.mark.parametrize("shape", DECAY_SHAPES)
def test_wsd_phase_boundaries(shape):
    t = _train(decay_shape=shape)
    assert decay_start(t) == 800
    lr = learning_rate_schedule(t)
    values = np.array([float(lr(c)) for c in range(1101)])
    np.testing.assert_allclose(values[[0, 50, 100]], [0.0, LR / 2, LR], rtol=1e-6)  # warmup from 0, ends at lr
    np.testing.assert_allclose(values[100:801], LR, rtol=1e-6)  # stable, up to and at the decay start
    assert values[801] < LR * (1 - 1e-5)  # the decay has begun
    np.testing.assert_allclose(values[850], MIN_LR + (LR - MIN_LR) * QUARTER[shape], rtol=1e-5)
    np.testing.assert_allclose(values[1000:], MIN_LR, rtol=1e-6)  # min_lr at the end, and after it
    assert np.all(np.diff(values[100:]) <= 1e-12)


def test_constant_boundaries():  # cosine's: tests/train/test_optim_flops.py
    lr = learning_rate_schedule(_train(lr_schedule="constant"))
    np.testing.assert_allclose([float(lr(c)) for c in (0, 50, 100, 999, 5000)], [0.0, LR / 2, LR, LR, LR], rtol=1e-6)


@pytest.mark.parametrize("overrides,message", [
    ({"lr_schedule": "step"}, r"train.lr_schedule='step' must be one of cosine, wsd, constant"),
    ({"decay_shape": "sqrt"}, r"train.decay_shape='sqrt' must be one of linear, cosine, 1-sqrt"),
    ({"decay_fraction": 1.5}, r"train.decay_fraction=1.5 must be in \(0, 1\]"),
    ({"decay_fraction": 0.95}, r"train.warmup_steps=100 and the WSD decay's 950 steps .* overlap"),
])
def test_bad_schedules_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _train(**overrides)


def test_a_longer_wsd_run_continues_its_stable_phase_exactly():
    """1000 -> 1500 steps at step 600 (stable): every update up to the old decay start has the same lr, and the
    note says so; the decay now starts at 1200."""
    old, new = _train(), _train(steps=1500)
    before, after = learning_rate_schedule(old), learning_rate_schedule(new)
    counts = np.arange(0, 801)
    np.testing.assert_array_equal(np.asarray(before(counts)), np.asarray(after(counts)))
    assert float(after(1200)) == pytest.approx(LR) and float(after(1300)) < LR
    note = continuation_note(new, {"train.steps": (1000, 1500)}, 600)
    assert note == ("note: train.steps: 1000 -> 1500 from step 601: the schedule is now wsd: 0 -> 1.00e-03 over 100 "
                    "warmup steps, 1.00e-03 to step 1200, then a 1-sqrt decay to 1.00e-04 at step 1500; the lr of "
                    "step 601 is 1.000e-03, as it was (the stable phase changed length)")


def test_a_wsd_run_whose_decay_has_begun_is_not_re_timed():
    new = _train(steps=1500)
    with pytest.raises(ConfigChangeRefused, match=r"train.steps: 1000 -> 1500 at step 900: the WSD decay had begun "
                                                  r"\(at step 800, now 1200\), so the learning rate would jump from "
                                                  r"3.636e-04 to 1.000e-03; .*branch_from=WORKDIR:STEP.*"
                                                  r"allow_config_change=true"):
        continuation_note(new, {"train.steps": (1000, 1500)}, 900)
    with pytest.raises(ConfigChangeRefused, match="the WSD decay had begun"):  # shortened into the past
        continuation_note(_train(steps=900), {"train.steps": (1000, 900)}, 750)
    new.allow_config_change = True
    note = continuation_note(new, {"train.steps": (1000, 1500)}, 900)
    assert note.endswith(f"the lr of step 901 is 1.000e-03 where the run had {lr_at(_train(), 900):.3e}")


def test_a_resume_with_more_steps_prints_the_cosine_rule(run_copy):
    """Issue 49 item 6: a longer cosine run used to re-stretch its lr silently; the preflight now says so."""
    checked = preflight(run_config(run_copy, steps=30))
    checked.lock.release()
    (note,) = [n for n in checked.notes if n.startswith("note: train.steps")]
    was, now = lr_at(run_config("").train, 20), lr_at(run_config("", steps=30).train, 20)
    assert note == (f"note: train.steps: 20 -> 30 from step 21: the schedule is now cosine: 0 -> 3.00e-03 over 5 "
                    f"warmup steps, cosine to 3.00e-04 at step 30; the lr of step 21 is {now:.3e} where the run had "
                    f"{was:.3e} (the cosine is stretched over the new length, not continued; train.lr_schedule=wsd "
                    "keeps the lr)")
    assert now > 2 * was
