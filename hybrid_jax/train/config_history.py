"""The run config as history: ``config.json`` as the run began, ``config-STEP.json`` for each change on resume.

A resumed run compares its config with the one in effect at the step it resumes from
(:func:`hybrid_jax.checkpoints.read_config`). No change: nothing is written. Changes: they are printed as a diff
and the whole new config is saved as ``config-STEP.json`` (``STEP``: the first step trained with it), so
``config.json`` keeps the run's start and :func:`hybrid_jax.load` reads the config of the checkpoint it loads.
A change to the model's function (any ``model.*`` key but the ones that only choose how it is computed) is
refused unless ``train.allow_config_change=true``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from hybrid_jax.checkpoints import CONFIG, config_history, read_config
from hybrid_jax.config import to_json

# Keys that never enter the history: how this launch runs, not what the run is.
RUN_CONTROL = frozenset({"train.restore_step", "train.allow_config_change", "train.workdir"})
# model.* keys that choose how the same function is computed (kernels, memory), not the function.
HOW_COMPUTED = frozenset({"model.name", "model.kernel_impl", "model.chunk_size", "model.tuning", "model.remat"})


class ConfigChangeRefused(ValueError):
    """A resumed run would change what the model computes."""


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def diff(old: ConfigDict, new: ConfigDict) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` of every differing key outside :data:`RUN_CONTROL`."""
    a, b = flatten(json.loads(to_json(old))), flatten(json.loads(to_json(new)))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if k not in RUN_CONTROL and a.get(k) != b.get(k)}


def function_changes(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    """The keys of ``changes`` that alter the model's function."""
    return [k for k in changes if k.startswith("model.") and k not in HOW_COMPUTED]


def record(workdir: Path, config: ConfigDict, resumed_from: int | None, log: Callable[[str], None] = print, *,
           write: bool = True) -> None:
    """Save ``config`` into the history of ``workdir`` for a run that resumes from ``resumed_from`` (None: a new
    run, which writes ``config.json``); :class:`ConfigChangeRefused` for a model-function change not allowed.
    ``write=False`` (processes other than 0) only checks."""
    if resumed_from is None or not (workdir / CONFIG).is_file():
        if write:
            (workdir / CONFIG).write_text(to_json(config))
        return
    changes = diff(read_config(workdir, resumed_from), config)
    if not changes:
        return
    shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
    refused = function_changes(changes)
    if refused and not config.train.allow_config_change:
        raise ConfigChangeRefused(
            f"resuming {workdir} at step {resumed_from} with {', '.join(refused)} changed ({shown}) would change "
            "what the trained model computes; rerun with the saved config (see hybrid_jax.checkpoints.read_config), "
            "use a new train.workdir, or pass --config.train.allow_config_change=true to change it anyway"
        )
    first = resumed_from + 1
    path = workdir / f"config-{first}.json"
    if not write:
        return
    path.write_text(to_json(config))
    log(f"config changed from step {first} (saved as {path.name}; config.json keeps the start): {shown}")


def set_aside_after(workdir: Path, step: int, folder: Path) -> list[Path]:
    """Move the ``config-STEP.json`` of steps after ``step`` (a rewound timeline) into ``folder``."""
    moved = []
    for first, path in config_history(workdir):
        if first > step and path.name != CONFIG:
            folder.mkdir(parents=True, exist_ok=True)
            moved.append(Path(shutil.move(str(path), str(folder / path.name))))
    return moved
