"""Checkpoints: an Orbax ``CheckpointManager`` in ``WORKDIR/checkpoints`` with two items per step.

* ``state``: the train state (params, optimizer state, step, skip counters, RNG), saved asynchronously.
* ``data``: the Grain iterator's state (Grain's Orbax handler), so a resumed run sees the very next batch.

Orbax writes each step into a temporary directory and renames it when complete; ``latest_step()`` only
sees complete ones and leftovers of a killed save are removed when the manager opens, so a run killed
mid-save resumes from the previous checkpoint. Before restoring, the saved shapes are compared with the
model's and any difference is a ``ValueError`` naming the parameter and both shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from ml_collections import ConfigDict


class Checkpointer:
    """Save every ``train.save_every`` steps (and on demand), keep the newest ``train.keep_checkpoints``."""

    def __init__(self, workdir: str | Path, train_cfg: ConfigDict | None = None, *, read_only: bool = False):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=train_cfg.save_every if train_cfg else 1,
            max_to_keep=train_cfg.keep_checkpoints if train_cfg else None,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self.manager = ocp.CheckpointManager(
            Path(workdir).resolve() / "checkpoints",
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
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.manager.directory}")
        saved = _metadata_tree(self.manager.item_metadata(step)["state"])
        check_shapes(abstract_state.get("params", {}), saved.get("params", {}), prefix="params/")  # params first
        check_shapes(abstract_state, saved)
        items = dict(
            state=ocp.args.PyTreeRestore(
                item=abstract_state,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                partial_restore=True,
            )
        )
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(item=data_iter)
        return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def wait(self) -> None:
        """Block until pending async saves are complete."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _metadata_tree(metadata: Any) -> Any:
    """Orbax's saved-tree metadata: nested containers of objects with ``.shape``."""
    return getattr(metadata, "tree", metadata)


def _name(path: tuple) -> str:
    """A key path as ``a/b/0/c`` (the same for dict keys, attributes and sequence indices)."""
    parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(p) for p in parts)


def check_shapes(expected: Any, saved: Any, prefix: str = "") -> None:
    """Raise ValueError naming the first leaf of ``expected`` that ``saved`` lacks or holds in another shape."""
    saved_leaves = {_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(expected):
        name = _name(path)
        if name not in saved_leaves:
            raise ValueError(
                f"checkpoint does not match this model: it has no parameter {prefix}{name} "
                f"(shape {tuple(np.shape(leaf))}); it was written by a model of another architecture"
            )
        want, got = tuple(np.shape(leaf)), tuple(saved_leaves[name].shape)
        if want != got:
            raise ValueError(
                f"checkpoint does not match this model: {prefix}{name} has shape {got} in the checkpoint but "
                f"{want} in the model; restore it with the config it was trained with"
            )
