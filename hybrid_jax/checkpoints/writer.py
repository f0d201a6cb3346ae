"""Saving checkpoints: an Orbax ``CheckpointManager`` in ``WORKDIR/checkpoints`` with two items per step.

* ``state``: the train state (params, optimizer state, step, skip counters, RNG), saved asynchronously.
* ``data``: the data position (JSON: the sequences consumed so far and what they are sequences of), so a resumed run
  continues with the very next sequence whatever its batch size.

When saves happen: every ``train.save_every`` steps (Orbax's ``FixedIntervalPolicy``; its default initial save
at the first step is left out), on demand, and at the end of a run. Which are kept: the newest
``train.keep_checkpoints`` (``LatestN``) plus the newest healthy one (saved with no skipped step in a row), so a run
of skipped steps never rotates out the last good checkpoint. Health is read from each step's ``integrity.json``,
written with it, so the rule holds across restarts.

Orbax writes each step into a temporary directory and renames it when complete; leftovers of a killed save are
removed when the manager opens, so a run killed mid-save resumes from the previous checkpoint. Just before that
rename every file gets a SHA-256 and the step its config (:mod:`hybrid_jax.checkpoints.integrity`). A save that
cannot be written is one line (:class:`~hybrid_jax.checkpoints.storage.CheckpointSaveError`), never a traceback of
Orbax's background thread.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from ml_collections import ConfigDict
from orbax.checkpoint import checkpoint_managers as policies

from hybrid_jax.checkpoints import integrity
from hybrid_jax.checkpoints.layout import checkpoint_dir
from hybrid_jax.checkpoints.reader import CheckpointDamaged, CheckpointReader
from hybrid_jax.checkpoints.storage import cause_of, check_writable, save_error
from hybrid_jax.config import to_json

HEALTH = "skipped_in_a_row"  # the train-state counter saved as each checkpoint's health: 0 means healthy


@dataclasses.dataclass
class KeepNewestHealthy:
    """Orbax preservation policy: keep the newest checkpoint saved with ``skipped_in_a_row == 0``. A step saved by
    this process knows its health from the save call; one read back from disk from its ``integrity.json``."""

    directory: Path

    def health(self, checkpoint: Any) -> int | None:
        if checkpoint.metrics and HEALTH in checkpoint.metrics:
            return int(checkpoint.metrics[HEALTH])
        return integrity.skipped_in_a_row(self.directory / str(checkpoint.step))

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        keep = max((c.step for c in checkpoints if self.health(c) == 0), default=None)
        return [c.step == keep for c in checkpoints]


class _QuietFailedWrites(logging.Filter):
    """A failed background write is reported by the trainer in one line at the next step: Orbax's and asyncio's logs
    of the same failure (hundreds of lines for a full disk, some only when the process exits) are dropped; anything
    else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return cause_of(error or Exception(record.getMessage())) is None


def _quiet_closed_loops(unraisable) -> None:
    """``sys.unraisablehook``: after a failed write, TensorStore's pending callbacks find Orbax's event loop closed;
    those are dropped, any other unraisable exception goes to the hook before."""
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
        _previous_hook(unraisable)


_previous_hook = sys.unraisablehook


def _quiet_failed_writes() -> None:
    """Install the filters above (once per process: the noise outlives the checkpointer)."""
    global _previous_hook
    if sys.unraisablehook is not _quiet_closed_loops:
        _previous_hook, sys.unraisablehook = sys.unraisablehook, _quiet_closed_loops
    for name in ("absl", "asyncio"):
        if _QUIET not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_QUIET)


class Checkpointer:
    """Save every ``train.save_every`` steps (and on demand) and keep the newest ``train.keep_checkpoints`` and the
    newest healthy one; restore a step. Reading a run without writing to it: :class:`CheckpointReader`."""

    def __init__(self, workdir: str | Path, config: ConfigDict):
        self.workdir = Path(workdir).resolve()
        self.directory = checkpoint_dir(workdir)
        check_writable(self.directory)
        self._config_json = to_json(config)
        self._pending: collections.deque[tuple[int, int]] = collections.deque()  # (step, health) of saves started
        t = config.train
        preserve = policies.AnyPreservationPolicy([policies.LatestN(n=t.keep_checkpoints),
                                                   KeepNewestHealthy(self.directory)])
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [policies.FixedIntervalPolicy(t.save_every), policies.PreemptionCheckpointingPolicy()]
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
            self.directory, item_names=("state", "data"),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
            options=options,
        )
        self.reader = CheckpointReader(workdir)
        _quiet_failed_writes()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The complete checkpoint steps, oldest first."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, data_position: dict, *, force: bool = False) -> bool:
        """Start an async save of ``state`` and ``data_position`` at ``step`` if due (or ``force``); True if started.

        A save that cannot be written is a :class:`CheckpointSaveError`: at this call when the folder cannot be
        created, at the next call (the next step) when the background write failed. Call it every step."""
        try:
            self.manager.check_for_errors()  # the background write of the previous save
            if not (force or self.manager.should_save(step)):
                return False
            health = int(state[HEALTH])
            args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_position))
            self._pending.append((step, health))  # before the save: its hook may run before save() returns
            started = self.manager.save(step, args=args, metrics={HEALTH: health}, force=force)
        except Exception as e:  # noqa: BLE001 (a storage problem becomes one line naming the folder)
            if (error := save_error(e, self.directory, self._in_flight())) is None:
                raise
            raise error from None
        if not started:
            self._pending.pop()
        return started

    def _in_flight(self) -> int | None:
        return self._pending[0][0] if self._pending else None

    def _write_manifest(self) -> None:
        """Orbax's post-finalization hook (primary process, before the rename): the step's config and checksums."""
        if not self._pending:
            return
        step, health = self._pending.popleft()  # saves finalize one at a time, in order
        pending = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        folder = pending[-1] if pending else self.directory / str(step)
        if folder.is_dir():
            integrity.write_manifest(folder, skipped_in_a_row=health, config_json=self._config_json)

    def wait(self) -> None:
        """Block until pending async saves are complete (a failed one is a :class:`CheckpointSaveError`)."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            if (error := save_error(e, self.directory, self._in_flight())) is None:
                raise
            raise error from None

    def restore(self, abstract_state: dict, step: int) -> tuple[dict, dict]:
        """``(state, data position)`` saved at ``step``, in the shardings of ``abstract_state``'s leaves, after the
        step's checks (:class:`~hybrid_jax.checkpoints.reader.CheckpointDamaged` when they fail)."""
        return self.reader.restore(abstract_state, step), read_data_position(self.directory / str(step))

    def reload(self) -> None:
        """See the step folders again after some were moved (quarantine, restore_step)."""
        self.manager.reload()
        self.reader.manager.reload()

    def close(self) -> None:
        self.reader.close()
        self.manager.close()


_QUIET = _QuietFailedWrites()


def read_data_position(step_dir: Path) -> dict:
    """The data position saved in ``step_dir``: ``{"sequences": N, ...}``; from a checkpoint of the older format
    (Grain's iterator state, which counted this process's batches) ``{"batches": N}``."""
    data = step_dir / "data"
    try:
        if (data / "metadata").is_file():
            return dict(json.loads((data / "metadata").read_text()))
        grain_state = sorted(data.glob("process_*-of-*.json"))
        if grain_state:
            return {"batches": int(json.loads(grain_state[0].read_text())["next_index"])}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(f"the data position of checkpoint step {step_dir.name} is unreadable "
                                f"({type(e).__name__})") from None
    raise CheckpointDamaged(f"checkpoint step {step_dir.name} has no data position")
