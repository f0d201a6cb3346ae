"""The learning-rate schedules (``train.lr_schedule``) and what a changed schedule does to a run that continues.

Every schedule warms up linearly from 0 to ``train.lr`` over ``train.warmup_steps``. ``count`` is the number of
updates applied so far: step ``s`` of a run applies update ``count = s - 1`` (less the skipped steps). Then:

* ``cosine`` (default): cosine from ``lr`` to ``min_lr`` at ``count = steps`` (optax's
  ``warmup_cosine_decay_schedule``, the FLA / Primus recipe).
* ``wsd`` (warmup, stable, decay): ``lr`` up to ``decay_start = steps - decay_steps``, ``decay_steps =
  round(decay_fraction x steps)``, then down to ``min_lr`` at ``steps`` along ``decay_shape``, with ``p`` the share
  of the decay done: ``linear`` ``1 - p``, ``cosine`` ``(1 + cos(pi p)) / 2``, ``1-sqrt`` ``1 - sqrt(p)`` of
  ``lr - min_lr`` above ``min_lr``. A longer ``steps`` only lengthens the stable phase, so a run can be extended
  while it is stable without a jump in its learning rate.
* ``constant``: ``lr`` after the warmup.

:func:`continuation_note` says what a resumed (or branched) run's new schedule does at the step it continues from,
and refuses, unless ``train.allow_config_change``, a WSD run whose length changes once its decay has begun.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax
from ml_collections import ConfigDict

from hybrid_jax.checkpoints.history import ConfigChangeRefused, shown

SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
# the keys that shape the schedule: a change of any on resume prints the new rule
SCHEDULE_KEYS = ("lr_schedule", "steps", "warmup_steps", "lr", "min_lr", "decay_fraction", "decay_shape")
# the keys that move a WSD decay in time: refused once the decay has begun (the learning rate would jump)
DECAY_TIMING = ("steps", "decay_fraction")


def decay_steps(train_cfg: ConfigDict) -> int:
    """Updates of the WSD decay: ``round(decay_fraction x steps)``."""
    return int(round(train_cfg.decay_fraction * train_cfg.steps))


def decay_start(train_cfg: ConfigDict) -> int:
    """The ``count`` at which the WSD decay begins (its learning rate is still ``lr`` there)."""
    return train_cfg.steps - decay_steps(train_cfg)


def _decay_factor(shape: str, p: jnp.ndarray) -> jnp.ndarray:
    """The share of ``lr - min_lr`` left above ``min_lr`` after a share ``p`` in [0, 1] of the decay."""
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + jnp.cos(jnp.pi * p))
    return 1.0 - jnp.sqrt(p)  # 1-sqrt


def learning_rate_schedule(train_cfg: ConfigDict) -> optax.Schedule:
    """``count -> learning rate`` (jittable) of ``train_cfg.lr_schedule`` (module docstring)."""
    t = train_cfg
    if t.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
                                                  decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.min_lr)
    peak, low, warmup = float(t.lr), float(t.min_lr), t.warmup_steps
    start, length, shape, wsd = decay_start(t), max(decay_steps(t), 1), t.decay_shape, t.lr_schedule == "wsd"

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        warming = peak * c / max(warmup, 1)
        after = peak
        if wsd:
            p = jnp.clip((c - start) / length, 0.0, 1.0)
            after = low + (peak - low) * _decay_factor(shape, p)
        return jnp.where(c < warmup, warming, after)

    return schedule


def lr_at(train_cfg: ConfigDict, count: int) -> float:
    """The learning rate of update ``count`` (the update of step ``count + 1``)."""
    return float(learning_rate_schedule(train_cfg)(count))


def describe(train_cfg: ConfigDict) -> str:
    """The schedule as words, e.g. ``wsd: 0 -> 3.00e-03 over 30 warmup steps, 3.00e-03 to step 240, then a 1-sqrt
    decay to 3.00e-04 at step 300``."""
    t = train_cfg
    warm = f"0 -> {t.lr:.2e} over {t.warmup_steps} warmup steps, " if t.warmup_steps else ""
    if t.lr_schedule == "cosine":
        return f"cosine: {warm}cosine to {t.min_lr:.2e} at step {t.steps}"
    if t.lr_schedule == "constant":
        return f"constant: {warm}{t.lr:.2e} to the end"
    return (f"wsd: {warm}{t.lr:.2e} to step {decay_start(t)}, then a {t.decay_shape} decay to {t.min_lr:.2e} at "
            f"step {t.steps}")


def previous_train(train_cfg: ConfigDict, changes: dict[str, tuple]) -> ConfigDict:
    """``train_cfg`` with the ``train.*`` keys of ``changes`` (``{key: (old, new)}``) back at their old values."""
    old = ConfigDict(train_cfg.to_dict())
    for key, (before, _) in changes.items():
        section, _, name = key.partition(".")
        if section == "train" and name in old and before is not None:
            old[name] = before
    return old


def continuation_note(train_cfg: ConfigDict, changes: dict[str, tuple], step: int) -> str | None:
    """The line to print when a run continues after ``step`` with ``changes`` (``{key: (old, new)}`` against the
    config ``step`` was trained with) to its schedule, or None when the schedule did not change.

    :class:`~hybrid_jax.checkpoints.history.ConfigChangeRefused` (unless ``train.allow_config_change``) when a WSD
    run's ``steps`` or ``decay_fraction`` changes after its decay has begun, by the old schedule or the new one: the
    learning rate would jump there. A run that must decay elsewhere branches from a stable checkpoint instead
    (``train.branch_from``)."""
    changed = {k: v for k, v in changes.items() if k.startswith("train.") and k[6:] in SCHEDULE_KEYS}
    if not changed:
        return None
    old = previous_train(train_cfg, changes)
    was, now = lr_at(old, step), lr_at(train_cfg, step)
    same = math.isclose(was, now, rel_tol=1e-6, abs_tol=1e-12)
    timing = [k for k in changed if k[6:] in DECAY_TIMING]
    wsd = old.lr_schedule == train_cfg.lr_schedule == "wsd"
    began = wsd and timing and step > min(decay_start(old), decay_start(train_cfg))
    lr_line = (f"the lr of step {step + 1} is {now:.3e}, as it was" if same else
               f"the lr of step {step + 1} is {now:.3e} where the run had {was:.3e}")
    if began and not same and not train_cfg.allow_config_change:
        raise ConfigChangeRefused(
            f"{shown(changed)} at step {step}: the WSD decay had begun (at step {decay_start(old)}, now "
            f"{decay_start(train_cfg)}), so the learning rate would jump from {was:.3e} to {now:.3e}; keep "
            f"train.steps={old.steps} and train.decay_fraction={old.decay_fraction}, branch a new decay from a "
            "stable checkpoint into a new workdir (--config.train.branch_from=WORKDIR:STEP), or pass "
            "--config.train.allow_config_change=true to take the jump")
    why = ""
    if not same and train_cfg.lr_schedule == "cosine" and "train.steps" in changed:
        why = " (the cosine is stretched over the new length, not continued; train.lr_schedule=wsd keeps the lr)"
    elif same and wsd and timing:
        why = " (the stable phase changed length)"
    return f"note: {shown(changed)} from step {step + 1}: the schedule is now {describe(train_cfg)}; {lr_line}{why}"
