"""Checkpoints: an Orbax ``CheckpointManager`` in ``WORKDIR/checkpoints`` with two items per step.

* ``state``: the train state (params, optimizer state, step, skip counters, RNG), saved asynchronously.
* ``data``: the Grain iterator's state (Grain's Orbax handler), so a resumed run sees the very next batch.

Orbax writes each step into a temporary directory and renames it when complete; ``latest_step()`` only
sees complete ones and leftovers of a killed save are removed when the manager opens, so a run killed
mid-save resumes from the previous checkpoint. The read side (directory layout, shape checks before a
restore, the restore arguments of the state) is :mod:`hybrid_jax.checkpoints`, shared with inference.
"""

from __future__ import annotations

from pathlib import Path

import grain
import orbax.checkpoint as ocp
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import checkpoint_dir, resolve_step, state_restore_args


class Checkpointer:
    """Save every ``train.save_every`` steps (and on demand), keep the newest ``train.keep_checkpoints``; restore
    the state and the iterator to resume. Reading a run without writing to it:
    :class:`hybrid_jax.checkpoints.CheckpointReader`."""

    def __init__(self, workdir: str | Path, train_cfg: ConfigDict | None = None):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=train_cfg.save_every if train_cfg else 1,
            max_to_keep=train_cfg.keep_checkpoints if train_cfg else None,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            checkpoint_dir(workdir),
            item_names=("state", "data"),
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()},
            options=options,
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_iter: grain.DatasetIterator, *, force: bool = False) -> bool:
        """Start an async save of ``state`` and the iterator at ``step`` if due (or ``force``); True if started."""
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=grain.checkpoint.CheckpointSave(item=data_iter)
            ),
            force=force,
        )

    def restore(self, abstract_state: dict, data_iter: grain.DatasetIterator | None, step: int | None = None) -> dict:
        """The saved state at ``step`` (default newest) in the shardings of ``abstract_state``'s leaves.

        ``abstract_state`` may be a subtree of what was saved (e.g. only ``{"params": ...}``); the iterator,
        when given, is moved to the saved position in place.
        """
        step = resolve_step(self.manager, step)
        items = dict(state=state_restore_args(self.manager, abstract_state, step))
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(item=data_iter)
        return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def wait(self) -> None:
        """Block until pending async saves are complete."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

