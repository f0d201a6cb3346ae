"""Reading a run directory's checkpoints: verified restores, shape checks, ``hybrid_jax.load``.

Shared by inference (``hybrid_jax.load``: export, eval, generate, notebooks) and by the trainer's resume; it never
writes, so it is safe on a directory that a running trainer is writing into. Only complete steps are seen (Orbax
renames a step's temporary directory when its save is done). Every restore first checks the step's files against
their checksums (:mod:`hybrid_jax.checkpoints.integrity`) and the saved shapes against the target's: a damaged
checkpoint is a :class:`CheckpointDamaged`, one of another model a :class:`CheckpointMismatch`, each one line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import integrity
from hybrid_jax.checkpoints.history import parse, read_config
from hybrid_jax.checkpoints.layout import checkpoint_dir, saved_steps
from hybrid_jax.model import HybridLM


class _ReadOnlyNote(logging.Filter):
    """Orbax warns that a read-only manager's directory "is read only" (it is, on purpose): that line goes; every
    other warning stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_ReadOnlyNote())


class CheckpointMismatch(ValueError):
    """A checkpoint written by a model of another shape or architecture (not a damaged checkpoint)."""


class CheckpointDamaged(OSError):
    """A checkpoint whose files fail their checks or cannot be read."""


def verified(workdir: str | Path, step: int) -> None:
    """:class:`CheckpointDamaged` (one line: what is wrong, what to do) unless checkpoint ``step`` passes its checks."""
    if (reason := integrity.verify(checkpoint_dir(workdir) / str(step))) is not None:
        others = [s for s in saved_steps(workdir) if s != step]
        raise CheckpointDamaged(f"checkpoint step {step} of {workdir} is damaged: {reason}; load another step "
                                f"({others or 'there is none'})")


class CheckpointReader:
    """Read-only view of ``WORKDIR/checkpoints``: the complete steps and their saved train state (or a subtree).
    Use as a context manager, or call :meth:`close`."""

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                               save_interval_steps=0)  # Orbax sets 0 itself (with a warning)
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(checkpoint_dir(workdir), item_names=tuple(handlers),
                                             item_handlers=handlers, options=options)
        self._verified: set[int] = set()

    def steps(self) -> list[int]:
        """The complete checkpoint steps, oldest first."""
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def verify(self, step: int) -> None:
        """:class:`CheckpointDamaged` unless ``step`` passes its checksums (checked once per reader)."""
        if step not in self._verified:
            verified(self.workdir, step)
            self._verified.add(step)

    def saved_tree(self, step: int) -> Any:
        """The saved state's metadata tree (leaves with ``.shape``) of a verified ``step``."""
        self.verify(step)
        try:
            tree = self.manager.item_metadata(step)["state"]
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointDamaged(f"the metadata of checkpoint step {step} is unreadable ({type(e).__name__}: "
                                    f"{e})") from None
        tree = getattr(tree, "tree", tree)
        if tree is None:
            raise CheckpointDamaged(f"checkpoint step {step} has no metadata of its state")
        return tree

    def restore(self, abstract_state: dict, step: int | None = None) -> dict:
        """The saved state at ``step`` (default newest) in the shardings of ``abstract_state``'s leaves, after its
        checks; ``abstract_state`` may be a subtree of what was saved (e.g. only ``{"params": ...}``)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.manager.directory}")
        items = ocp.args.Composite(state=restore_args(self, abstract_state, step))
        try:
            return self.manager.restore(step, args=items)["state"]
        except (OSError, ValueError, KeyError, AttributeError, TypeError, IndexError) as e:
            raise CheckpointDamaged(f"checkpoint step {step} cannot be read ({type(e).__name__}: "
                                    f"{str(e).strip().splitlines()[0][:200] if str(e) else ''})") from None

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def restore_args(reader: CheckpointReader, abstract_state: dict, step: int) -> ocp.args.PyTreeRestore:
    """Restore arguments of the ``state`` item at ``step`` into ``abstract_state`` (``ShapeDtypeStruct`` leaves with
    shardings; a subtree of the saved state is fine), after checking the step and its shapes (params first)."""
    saved = reader.saved_tree(step)
    check_shapes(abstract_state.get("params", {}), saved.get("params", {}), prefix="params/")
    check_shapes(abstract_state, saved)
    return ocp.args.PyTreeRestore(item=abstract_state,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                                  partial_restore=True)


def latest_step(workdir: str | Path) -> int | None:
    """The newest complete checkpoint step of ``workdir`` (None if there is none)."""
    steps = saved_steps(workdir)
    return steps[-1] if steps else None


def trained_config(workdir: str | Path, step: int) -> ConfigDict:
    """The config checkpoint ``step`` was trained with: its own copy, else (a checkpoint written before the copy
    existed) the workdir's history at that step."""
    path = checkpoint_dir(workdir) / str(step) / "config.json"
    try:
        return parse(integrity.saved_config(path.parent), path)
    except OSError:
        return read_config(workdir, step)


def load(workdir: str | Path, step: int | None = None) -> tuple[HybridLM, ConfigDict]:
    """``hybrid_jax.load``: the model saved in ``workdir`` at ``step`` (default: the newest complete checkpoint) and
    the config it was trained with, after checking the checkpoint's files. Only the parameters are read (not the
    optimizer state), onto the first local device."""
    if step is None and (step := latest_step(workdir)) is None:
        raise FileNotFoundError(f"{checkpoint_dir(workdir)} holds no complete checkpoint: nothing to load")
    verified(workdir, step)
    config = trained_config(workdir, step)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0))), nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(abstract))
    with CheckpointReader(workdir) as reader:
        params = reader.restore({"params": target}, step)["params"]
    return nnx.merge(graphdef, params), config


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
