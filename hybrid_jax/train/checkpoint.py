"""Checkpoints: an Orbax ``CheckpointManager`` in ``WORKDIR/checkpoints`` with two items per step.

* ``state``: the train state (params, optimizer state, step, skip counters, RNG), saved asynchronously.
* ``data``: the Grain iterator's state (Grain's Orbax handler), so a resumed run sees the very next batch.

When saves happen: every ``train.save_every`` steps (Orbax's ``FixedIntervalPolicy``; its default initial save
at the first step is left out) and at the end of a run. Which are kept: the newest ``train.keep_checkpoints``
(``LatestN``) plus the newest healthy one (saved with no skipped step in a row), so a run of skipped steps
never rotates out the last good checkpoint.

Orbax writes each step into a temporary directory and renames it when complete; ``latest_step()`` only
sees complete ones and leftovers of a killed save are removed when the manager opens, so a run killed
mid-save resumes from the previous checkpoint. Just before that rename, every file gets a SHA-256
(:mod:`hybrid_jax.train.integrity`); :meth:`Checkpointer.resume` checks them, restores, checks the state is
finite, and moves a checkpoint that fails aside, falling back to the next older one. The read side
(directory layout, shape checks before a restore, the restore arguments of the state) is
:mod:`hybrid_jax.checkpoints`, shared with inference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from ml_collections import ConfigDict
from orbax.checkpoint import checkpoint_managers as policies

from hybrid_jax.checkpoints import CheckpointMismatch, checkpoint_dir, resolve_step, state_restore_args
from hybrid_jax.train import integrity
from hybrid_jax.train.save_errors import CheckpointSaveError, check_writable, save_error

HEALTH = "skipped_in_a_row"  # the metric saved with each checkpoint: 0 means healthy


class NoUsableCheckpoint(RuntimeError):
    """No checkpoint of the workdir passed its checks (or the one asked for did not)."""


@dataclasses.dataclass
class KeepNewestHealthy:
    """Orbax preservation policy: keep the newest checkpoint saved with ``skipped_in_a_row == 0`` (or saved
    without metrics, by an older version)."""

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        healthy = [c.step for c in checkpoints if not (c.metrics or {}).get(HEALTH, 0)]
        keep = max(healthy, default=None)
        return [c.step == keep for c in checkpoints]


def all_finite(tree: Any) -> bool:
    """True when every floating-point leaf of ``tree`` is finite (no NaN, no inf)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return True
    return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves))


class Checkpointer:
    """Save every ``train.save_every`` steps (and on demand), keep the newest ``train.keep_checkpoints`` and the
    newest healthy one; resume from the newest checkpoint that passes its checks. Reading a run without
    writing to it: :class:`hybrid_jax.checkpoints.CheckpointReader`."""

    def __init__(self, workdir: str | Path, train_cfg: ConfigDict | None = None):
        self.workdir = Path(workdir).resolve()
        self.directory = checkpoint_dir(workdir)
        check_writable(self.directory)
        self._saving: int | None = None  # the step whose async save is in flight
        every = train_cfg.save_every if train_cfg else 1
        keep = train_cfg.keep_checkpoints if train_cfg else None
        preserve = None
        if keep is not None:
            preserve = policies.AnyPreservationPolicy([policies.LatestN(n=keep), KeepNewestHealthy()])
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [policies.FixedIntervalPolicy(every), policies.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=preserve,
            enable_async_checkpointing=True,
            # step folders created before save() returns: a folder that cannot be written fails at once, in one
            # line, instead of after Orbax's 5-minute wait for its background creation
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest,
                                           create_directories_asynchronously=False),
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "data"),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()},
            options=options,
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The complete checkpoint steps, oldest first."""
        return sorted(self.manager.all_steps())

    # --- saving ------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict, data_iter: grain.DatasetIterator, *, force: bool = False) -> bool:
        """Start an async save of ``state`` and the iterator at ``step`` if due (or ``force``); True if started.

        A save that cannot be written (folder not writable, disk full) is a :class:`CheckpointSaveError`: at
        this call when the folder cannot be created, at the next call (the next step) when the background
        write failed. Call it every step."""
        try:
            self.manager.check_for_errors()  # the background write of the previous save
            if not (force or self.manager.should_save(step)):
                return False
            metrics = {HEALTH: int(state[HEALTH])}
            args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                      data=grain.checkpoint.CheckpointSave(item=data_iter))
            started = self.manager.save(step, args=args, metrics=metrics, force=force)
        except Exception as e:  # noqa: BLE001 (a storage problem becomes one line naming the folder)
            if (error := save_error(e, self.directory, step if self._saving is None else self._saving)) is None:
                raise
            raise error from None
        if started:
            self._saving = step
        return started

    def _write_manifest(self) -> None:
        """Orbax's post-finalization hook (primary process, before the rename): checksums of the step's files."""
        step, self._saving = self._saving, None
        if step is None:
            return
        pending = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        folder = pending[-1] if pending else self.directory / str(step)
        if folder.is_dir():
            integrity.write_manifest(folder)

    def wait(self) -> None:
        """Block until pending async saves are complete (a failed one is a :class:`CheckpointSaveError`)."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            if (error := save_error(e, self.directory, self._saving)) is None:
                raise
            raise error from None

    def close(self) -> None:
        self.manager.close()

    # --- restoring ---------------------------------------------------------------------------------------

    def restore(self, abstract_state: dict, data_iter: grain.DatasetIterator | None, step: int | None = None) -> dict:
        """The saved state at ``step`` (default newest) in the shardings of ``abstract_state``'s leaves, unverified.

        ``abstract_state`` may be a subtree of what was saved (e.g. only ``{"params": ...}``); the iterator,
        when given, is moved to the saved position in place.
        """
        step = resolve_step(self.manager, step)
        items = dict(state=state_restore_args(self.manager, abstract_state, step))
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(item=data_iter)
        return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def resume(self, abstract_state: dict, data_iter: grain.DatasetIterator, *, step: int | None = None,
               log: Callable[[str], None] = print) -> tuple[dict, int] | None:
        """``(state, step)`` of the newest checkpoint that passes its checks (or exactly ``step``), None if there
        is none at all. Each candidate's files are checked against its manifest, then it is restored and its
        state checked finite; one that fails is moved to ``WORKDIR/checkpoints-quarantine/`` with a line saying
        why and the next older one is tried. :class:`NoUsableCheckpoint` when none passes (or ``step`` fails)."""
        candidates = sorted(self.manager.all_steps(), reverse=True)
        if step is not None:
            if step not in candidates:
                raise NoUsableCheckpoint(f"train.restore_step={step}: {self.directory} has no checkpoint at step "
                                         f"{step} (it has {sorted(candidates) or 'none'})")
            candidates = [step]
        for candidate in candidates:
            reason = self._check(candidate, abstract_state, data_iter, log)
            if isinstance(reason, dict):
                return reason, candidate
            moved = self._quarantine(candidate, reason)
            log(f"checkpoint step {candidate} is unusable: {reason}; moved to {moved}")
            if step is not None:
                raise NoUsableCheckpoint(f"train.restore_step={step}: that checkpoint is unusable ({reason}); it was "
                                         f"moved to {moved}; choose another step")
        if candidates:
            raise NoUsableCheckpoint(
                f"no checkpoint in {self.directory} passes its checks (all moved to "
                f"{self.workdir / integrity.QUARANTINE}, see README.txt there); start over in a new train.workdir")
        return None

    def _check(self, step: int, abstract_state: dict, data_iter: grain.DatasetIterator,
               log: Callable[[str], None]) -> dict | str:
        """The restored state, or why checkpoint ``step`` is unusable."""
        folder = self.directory / str(step)
        reason = None
        if jax.process_index() == 0:
            if integrity.has_manifest(folder):
                reason = integrity.verify(folder)
            else:
                log(f"checkpoint step {step} has no {integrity.MANIFEST} (written by an older version): not verified")
        if _any_process(reason is not None):
            return reason or "its files fail their checksums (see process 0)"
        try:
            state = self.restore(abstract_state, data_iter, step)
        except CheckpointMismatch:
            raise
        except (OSError, ValueError, KeyError, AttributeError, TypeError, IndexError) as e:
            return f"it cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''})"
        if not all_finite(state):
            return "its state holds non-finite values (NaN or inf)"
        return state

    def _quarantine(self, step: int, reason: str) -> Path:
        target = self.workdir / integrity.QUARANTINE / str(step)
        if jax.process_index() == 0:
            target = integrity.quarantine(self.workdir, self.directory / str(step), reason)
        _barrier(f"quarantine-{step}")
        self.manager.reload()
        return target

    def set_aside_after(self, step: int, why: str, log: Callable[[str], None] = print) -> list[int]:
        """Move every checkpoint newer than ``step`` to the quarantine folder (kept, never deleted)."""
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            log(f"checkpoint step {s} set aside ({why}): moved to {self._quarantine(s, why)}")
        return newer


def _any_process(flag: bool) -> bool:
    """``flag`` of process 0, the same on every process."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["CheckpointSaveError", "Checkpointer", "KeepNewestHealthy", "NoUsableCheckpoint", "all_finite"]
