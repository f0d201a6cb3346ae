"""Resuming a run: which checkpoint, decided before anything changes on disk, then carried out.

:func:`plan_resume` only reads: the newest checkpoint that passes its checksums (or exactly ``train.restore_step``),
its saved shapes against the model's, and the config change against the config it was trained with. Every refusal
(a shape of another model, a change that needs ``train.allow_config_change``, a damaged or absent
``restore_step``, no usable checkpoint at all) is raised from there, so a refusal changes nothing on disk.
:func:`carry_out` then restores the chosen step (falling back to the next older one if it cannot be read or holds
non-finite values), and only then moves aside what the plan says: damaged newer checkpoints to
``WORKDIR/checkpoints-quarantine/`` (never deleted), the checkpoints and ``config-STEP.json`` newer than a
``restore_step``, records ``restore_step.json`` (so relaunching the same command resumes from the newest checkpoint
again instead of rewinding twice; delete it to rewind to the same step again) and the config history.

A new workdir with ``train.branch_from=WORKDIR[:STEP]`` starts from another run's checkpoint instead
(:func:`plan_branch`): that step (default: its newest) is verified and shape-checked like a resume, its state and
data position are restored from where they are (nothing is copied), and the new run keeps its own config
(``config.json``) and checkpoints, with ``branched_from.json`` naming its origin. Once the new workdir holds a
checkpoint of its own, it resumes from that one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import history, integrity
from hybrid_jax.checkpoints.layout import BRANCHED, RESTORED, checkpoint_dir, saved_steps, step_dir
from hybrid_jax.checkpoints.reader import CheckpointDamaged, CheckpointReader, check_shapes, trained_config
from hybrid_jax.checkpoints.writer import Checkpointer, read_data_position


class NoUsableCheckpoint(RuntimeError):
    """No checkpoint of the workdir passes its checks (or the one asked for does not)."""


@dataclasses.dataclass
class ResumePlan:
    """What resuming will do. ``step``: the checkpoint to continue from (None: a fresh run); ``damaged``: newer
    checkpoints that failed their checks, with why; ``set_aside``: checkpoints newer than ``train.restore_step``;
    ``changes``: the config changes against the config ``step`` was trained with; ``notes``: lines to print;
    ``source``: the workdir ``step`` is read from when it is another run's (``train.branch_from``)."""

    step: int | None
    damaged: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    set_aside: list[int] = dataclasses.field(default_factory=list)
    rewind_to: int | None = None
    changes: dict = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    source: Path | None = None


def _verdict(workdir: Path, step: int) -> str | None:
    """Why checkpoint ``step`` fails its checksums (checked by process 0, the verdict shared), or None."""
    reason = integrity.verify(checkpoint_dir(workdir) / str(step)) if jax.process_index() == 0 else None
    if jax.process_count() == 1:
        return reason
    from jax.experimental import multihost_utils

    failed = bool(multihost_utils.broadcast_one_to_all(np.int32(reason is not None)))
    return (reason or "its files fail their checksums (see process 0)") if failed else None


def _already_rewound(workdir: Path, step: int, newest: int) -> bool:
    try:
        done = json.loads((workdir / RESTORED).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(done, dict) and done.get("restore_step") == step and newest > step


def plan_resume(workdir: Path, config: ConfigDict, abstract_params: dict, *, skip: frozenset[int] = frozenset()
                ) -> ResumePlan:
    """Decide how ``config`` resumes in ``workdir`` (module docstring); reads only. ``abstract_params``: the model's
    parameter shapes; ``skip``: steps found unusable after planning (unreadable despite their checksums)."""
    steps = [s for s in saved_steps(workdir) if s not in skip]
    if not steps:
        return ResumePlan(step=None)
    plan = ResumePlan(step=None)
    restore = config.train.restore_step or None
    if restore is not None and _already_rewound(workdir, restore, steps[-1]):
        plan.notes.append(f"note: train.restore_step={restore} was applied already (see {workdir / RESTORED}); "
                          f"resuming from the newest checkpoint, step {steps[-1]}")
        restore = None
    if restore is not None:
        _require_healthy(workdir, steps, restore, f"train.restore_step={restore}")
        candidates, plan.rewind_to = [restore], restore
        plan.set_aside = [s for s in steps if s > restore]
    else:
        candidates = steps[::-1]
    with CheckpointReader(workdir) as reader:
        for step in candidates:
            reason = _verdict(workdir, step)
            if reason is None:
                reader._verified.add(step)
                try:
                    saved = reader.saved_tree(step)
                except CheckpointDamaged as e:
                    reason = str(e)
            if reason is not None:
                plan.damaged.append((step, reason))
                continue
            plan.changes = _check_against(workdir, step, saved, abstract_params, config,
                                          where=f"{workdir} step {step}", fix="; or use a new train.workdir")
            plan.step = step
            return plan
    why = "; ".join(f"step {s}: {r}" for s, r in plan.damaged)
    raise NoUsableCheckpoint(f"no checkpoint in {checkpoint_dir(workdir)} passes its checks ({why}); nothing was "
                             "moved: restore a good copy, or start over in a new train.workdir")


def _require_healthy(workdir: Path, steps: list[int], step: int, what: str) -> None:
    """:class:`NoUsableCheckpoint` naming ``what`` when ``workdir`` lacks checkpoint ``step`` or it fails its checks."""
    if step not in steps:
        raise NoUsableCheckpoint(f"{what}: {checkpoint_dir(workdir)} has no checkpoint at step {step} (it has {steps})")
    if (reason := _verdict(workdir, step)) is not None:
        raise NoUsableCheckpoint(f"{what}: checkpoint step {step} of {workdir} is damaged ({reason}); choose another "
                                 f"step ({[s for s in steps if s != step] or 'there is none'})")


def _check_against(workdir: Path, step: int, saved: dict, abstract_params: dict, config: ConfigDict, *, where: str,
                   fix: str = "") -> dict:
    """The config change from ``workdir``'s checkpoint ``step`` (its saved tree ``saved``) to ``config``, after its
    parameter shapes are checked against the model's; a refusal names ``where`` (and ends with ``fix``)."""
    try:
        check_shapes(abstract_params, saved.get("params", {}), prefix="params/")
    except ValueError as e:
        raise type(e)(f"{where}: {e}{fix}") from None
    try:
        trained = trained_config(workdir, step)
    except (OSError, ValueError) as e:
        raise history.ConfigUnreadable(f"{where}: its config cannot be read: {e}") from None
    return history.check_change(workdir, step, trained, config)


def parse_branch(spec: str) -> tuple[Path, int | None]:
    """``WORKDIR`` or ``WORKDIR:STEP`` (``train.branch_from``) -> ``(workdir, step or None)``."""
    head, _, tail = spec.rpartition(":")
    return (Path(head), int(tail)) if head and tail.isdigit() else (Path(spec), None)


def plan_branch(workdir: Path, config: ConfigDict, abstract_params: dict) -> ResumePlan:
    """How the fresh ``workdir`` starts from ``train.branch_from``'s checkpoint (module docstring); reads only.
    :class:`NoUsableCheckpoint` for a source without that step or whose step fails its checks; the shape and config
    checks of a resume (:func:`plan_resume`)."""
    spec = config.train.branch_from
    source, step = parse_branch(spec)
    source = source.resolve()
    if source == workdir.resolve():
        raise NoUsableCheckpoint(f"train.branch_from={spec} is this run's own workdir; to go back within a run use "
                                 "train.restore_step")
    steps = saved_steps(source)
    if not steps:
        raise NoUsableCheckpoint(f"train.branch_from={spec}: {checkpoint_dir(source)} holds no complete checkpoint")
    step = steps[-1] if step is None else step
    _require_healthy(source, steps, step, f"train.branch_from={spec}")
    with CheckpointReader(source) as reader:
        reader._verified.add(step)
        try:
            saved = reader.saved_tree(step)
        except CheckpointDamaged as e:
            raise NoUsableCheckpoint(f"train.branch_from={spec}: {e}") from None
    changes = _check_against(source, step, saved, abstract_params, config,
                             where=f"train.branch_from={spec} step {step}")
    return ResumePlan(step=step, changes=changes, source=source,
                      notes=[f"branching from {source} step {step}: its train state and data position, this run's "
                             f"config ({history.shown(changes) or 'unchanged'})"])


def _restore(plan: ResumePlan, ckpt: Checkpointer, abstract_state: dict) -> tuple[dict, dict]:
    """``(state, data position)`` of ``plan.step``, from this workdir or the branch's source."""
    if plan.source is None:
        return ckpt.restore(abstract_state, plan.step)
    with CheckpointReader(plan.source) as reader:
        return reader.restore(abstract_state, plan.step), read_data_position(step_dir(plan.source, plan.step))


def _finite(tree: Any) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return not leaves or bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves))


def carry_out(plan: ResumePlan, ckpt: Checkpointer, config: ConfigDict, abstract_state: dict,
              log: Callable[[str], None]) -> tuple[dict, dict] | None:
    """Restore ``plan.step`` (``(state, data position)``, or None for a fresh run), then make the plan's moves and
    record the config history (process 0)."""
    workdir, skip = ckpt.workdir, frozenset()
    for note in plan.notes:
        log(note)
    restored = None
    while plan.step is not None:
        try:
            state, position = _restore(plan, ckpt, abstract_state)
            if _finite(state):
                restored = (state, position)
                break
            reason = "its state holds non-finite values (NaN or inf)"
        except CheckpointDamaged as e:
            reason = str(e)
        if plan.source is not None:  # a branch's source is never changed: no fallback, nothing moved
            raise NoUsableCheckpoint(f"train.branch_from={config.train.branch_from}: {reason}")
        skip |= {plan.step}
        damaged = [*plan.damaged, (plan.step, reason)]
        plan = plan_resume(workdir, config, abstract_state["params"], skip=skip)
        plan.damaged = damaged + plan.damaged
    primary = jax.process_index() == 0
    if primary:
        for step, reason in plan.damaged:
            moved = integrity.quarantine(workdir, checkpoint_dir(workdir) / str(step), reason)
            log(f"checkpoint step {step} is unusable: {reason}; moved to {moved}")
        why = f"newer than train.restore_step={plan.rewind_to}"
        for step in plan.set_aside:
            moved = integrity.quarantine(workdir, checkpoint_dir(workdir) / str(step), why)
            log(f"checkpoint step {step} set aside ({why}): moved to {moved}")
    _barrier("resume-moves")
    if plan.damaged or plan.set_aside:
        ckpt.reload()
    if primary:
        if plan.step is not None:
            for path in history.set_aside_after(workdir, plan.step):
                log(f"{path.name} set aside (after the checkpoint resumed from, step {plan.step}): moved to {path}")
        if plan.rewind_to is not None:
            record = dict(restore_step=plan.rewind_to, set_aside=plan.set_aside,
                          time=time.strftime("%Y-%m-%d %H:%M:%S"))
            (workdir / RESTORED).write_text(json.dumps(record) + "\n")
        own = plan.step if plan.source is None else None  # a branch starts this workdir's history
        if own is not None:
            history.repair_start(workdir, integrity_config(workdir, min(saved_steps(workdir), default=None)), log)
        history.record(workdir, config, own, plan.changes, log)
        if plan.source is not None:
            record = dict(workdir=str(plan.source), step=plan.step, time=time.strftime("%Y-%m-%d %H:%M:%S"))
            (workdir / BRANCHED).write_text(json.dumps(record) + "\n")
    if plan.step is not None:
        log(f"resuming from {checkpoint_dir(plan.source or workdir)} step {plan.step}")
    return restored


def integrity_config(workdir: Path, step: int | None) -> str | None:
    """The config text checkpoint ``step`` carries, or None."""
    if step is None:
        return None
    try:
        return integrity.saved_config(checkpoint_dir(workdir) / str(step))
    except OSError:
        return None


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["NoUsableCheckpoint", "ResumePlan", "carry_out", "parse_branch", "plan_branch", "plan_resume"]
