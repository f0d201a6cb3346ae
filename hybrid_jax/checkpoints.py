"""Reading a run directory: its saved config, its complete checkpoint steps, its parameters, ``load``.

A run directory (``train.workdir``) holds ``config.json`` (the resolved run config; ``config-STEP.json`` for each
change a resumed run made, in effect from ``STEP``) and ``checkpoints/<step>/``,
one Orbax checkpoint per step with two items: ``state`` (the train state: params, optimizer state, step, skip
counters, RNG) and ``data`` (the Grain iterator's position). This module is the read side, shared by inference
(``hybrid_jax.load``, export, eval, generate, notebooks) and by the trainer's resume
(``hybrid_jax.train.checkpoint``, which adds saving and rotation); it imports nothing of ``hybrid_jax.train``.

Only complete steps are seen (Orbax renames a step's temporary directory when its save is done). Before any
restore the saved shapes are compared with the target's and a difference is a ``ValueError`` naming the
parameter and both shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import from_json
from hybrid_jax.model import HybridLM

CHECKPOINTS = "checkpoints"  # WORKDIR/checkpoints/<step>/{state,data}
CONFIG = "config.json"  # WORKDIR/config.json


def checkpoint_dir(workdir: str | Path) -> Path:
    """``WORKDIR/checkpoints`` (absolute)."""
    return Path(workdir).resolve() / CHECKPOINTS


def config_history(workdir: str | Path) -> list[tuple[int, Path]]:
    """``(first step, file)`` of each saved config, oldest first: ``config.json`` (step 1), then each
    ``config-STEP.json`` a resumed run wrote when it changed the config (in effect from ``STEP``)."""
    workdir = Path(workdir)
    history = [(1, workdir / CONFIG)] if (workdir / CONFIG).is_file() else []
    for path in workdir.glob("config-*.json"):
        if path.stem.removeprefix("config-").isdigit():
            history.append((int(path.stem.removeprefix("config-")), path))
    return sorted(history)


def read_config(workdir: str | Path, step: int | None = None) -> ConfigDict:
    """The run config (locked, as the trainer ran it) in effect at ``step`` (default: the newest one): the newest
    of ``config.json`` / ``config-STEP.json`` whose ``STEP <= step``."""
    history = config_history(workdir)
    if not history:
        path = Path(workdir) / CONFIG
        raise FileNotFoundError(f"{path} not found: {workdir} is not a training run directory (no saved config)")
    chosen = [path for first, path in history if step is None or first <= step] or [history[0][1]]
    return from_json(chosen[-1].read_text())


class CheckpointReader:
    """Read-only view of ``WORKDIR/checkpoints``: the complete steps and the saved train state (or a subtree).

    Never writes or cleans anything, so it is safe on a directory that a running trainer is writing into.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, workdir: str | Path):
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                               save_interval_steps=0)  # Orbax sets 0 itself (with a warning)
        self.manager = ocp.CheckpointManager(checkpoint_dir(workdir), item_names=("state",),
                                             item_handlers={"state": ocp.PyTreeCheckpointHandler()}, options=options)

    def steps(self) -> list[int]:
        """The complete checkpoint steps, oldest first."""
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: dict, step: int | None = None) -> dict:
        """The saved state at ``step`` (default newest) in the shardings of ``abstract_state``'s leaves;
        ``abstract_state`` may be a subtree of what was saved (e.g. only ``{"params": ...}``)."""
        step = resolve_step(self.manager, step)
        items = ocp.args.Composite(state=state_restore_args(self.manager, abstract_state, step))
        return self.manager.restore(step, args=items)["state"]

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def latest_step(workdir: str | Path) -> int | None:
    """The newest complete checkpoint step of ``workdir`` (None if there is none)."""
    with CheckpointReader(workdir) as reader:
        return reader.latest_step()


def resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    """``step``, or the manager's newest complete step; ``FileNotFoundError`` when there is none."""
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {manager.directory}")
    return step


class CheckpointMismatch(ValueError):
    """A checkpoint written by a model of another shape or architecture (not a damaged checkpoint)."""


def state_restore_args(manager: ocp.CheckpointManager, abstract_state: dict, step: int) -> ocp.args.PyTreeRestore:
    """Restore arguments of the ``state`` item at ``step`` into ``abstract_state`` (``ShapeDtypeStruct`` leaves with
    shardings; a subtree of the saved state is fine), after checking the saved shapes (params first)."""
    try:
        saved = _metadata_tree(manager.item_metadata(step)["state"])
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:  # metadata deleted or garbled
        raise OSError(f"the metadata of checkpoint step {step} is unreadable ({type(e).__name__}: {e})") from None
    if saved is None:
        raise OSError(f"checkpoint step {step} has no metadata of its state")
    check_shapes(abstract_state.get("params", {}), saved.get("params", {}), prefix="params/")
    check_shapes(abstract_state, saved)
    return ocp.args.PyTreeRestore(item=abstract_state,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                                  partial_restore=True)


def load(workdir: str | Path, step: int | None = None) -> tuple[HybridLM, ConfigDict]:
    """``hybrid_jax.load``: the model saved in ``workdir`` at ``step`` (default: the newest complete checkpoint) and
    its run config (the one in effect at that step, see :func:`read_config`). Only the parameters are read (not
    the optimizer state), onto the first local device."""
    if step is None:
        step = latest_step(workdir)
    config = read_config(workdir, step)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0))), nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(abstract))
    with CheckpointReader(workdir) as reader:
        params = reader.restore({"params": target}, step)["params"]
    return nnx.merge(graphdef, params), config


def _metadata_tree(metadata: Any) -> Any:
    """Orbax's saved-tree metadata: nested containers of objects with ``.shape``."""
    return getattr(metadata, "tree", metadata)


def _name(path: tuple) -> str:
    """A key path as ``a/b/0/c`` (the same for dict keys, attributes and sequence indices)."""
    parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(p) for p in parts)


def check_shapes(expected: Any, saved: Any, prefix: str = "") -> None:
    """Raise :class:`CheckpointMismatch` naming the first leaf of ``expected`` that ``saved`` lacks or holds in
    another shape."""
    saved_leaves = {_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(expected):
        name = _name(path)
        if name not in saved_leaves:
            raise CheckpointMismatch(
                f"checkpoint does not match this model: it has no parameter {prefix}{name} "
                f"(shape {tuple(np.shape(leaf))}); it was written by a model of another architecture"
            )
        want, got = tuple(np.shape(leaf)), tuple(saved_leaves[name].shape)
        if want != got:
            raise CheckpointMismatch(
                f"checkpoint does not match this model: {prefix}{name} has shape {got} in the checkpoint but "
                f"{want} in the model; restore it with the config it was trained with"
            )
