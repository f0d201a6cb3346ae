"""The run config as history: ``config.json`` as the run began, ``config-STEP.json`` for each change on resume.

A resumed run compares its config with the one its checkpoint was trained with (the copy inside the checkpoint,
``checkpoints/<step>/config.json``). No change: nothing is written. Changes are printed as a diff and the whole new
config is saved as ``config-STEP.json`` (``STEP``: the first step trained with it), so ``config.json`` keeps the
run's start and :func:`hybrid_jax.load` reads the config of the checkpoint it loads. Refused unless
``train.allow_config_change=true``: a change to the model's function (any ``model.*`` key but the ones that only
choose how it is computed) and a change of the data stream's order (``train.seq_len``, ``train.seed``).

A missing or unreadable ``config.json`` is rebuilt from the oldest checkpoint's copy (the unreadable one moved to the
quarantine folder), with a note.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from hybrid_jax.checkpoints.layout import CONFIG, QUARANTINE
from hybrid_jax.config import flat_items, from_json, to_json

# Keys that never enter the history: how this launch runs, not what the run is (train.branch_from is read only when
# a workdir starts).
RUN_CONTROL = frozenset({"train.restore_step", "train.allow_config_change", "train.workdir", "train.branch_from"})
# model.* keys that choose how the same function is computed (kernels, memory), not the function.
HOW_COMPUTED = frozenset({"model.name", "model.kernel_impl", "model.chunk_size", "model.tuning", "model.remat"})
# keys whose change reorders the data stream (the saved data position counts sequences of this length and seed)
DATA_ORDER = frozenset({"train.seq_len", "train.seed"})


class ConfigChangeRefused(ValueError):
    """A resumed run would change what the model computes or the order of its data."""


class ConfigUnreadable(ValueError):
    """A saved config file cannot be read; the message names it and what to do."""


def parse(text: str, path: Path | str) -> ConfigDict:
    """A saved config (:func:`hybrid_jax.config.to_json`) as a locked ``ConfigDict``; :class:`ConfigUnreadable`."""
    try:
        return from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigUnreadable(f"{path} is not a saved run config ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None


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
    try:
        text = chosen[-1].read_text()
    except OSError as e:
        raise ConfigUnreadable(f"{chosen[-1]} cannot be read ({e.strerror})") from None
    return parse(text, chosen[-1])


def diff(old: ConfigDict, new: ConfigDict) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` of every differing key outside :data:`RUN_CONTROL`."""
    a, b = dict(flat_items(json.loads(to_json(old)))), dict(flat_items(json.loads(to_json(new))))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if k not in RUN_CONTROL and a.get(k) != b.get(k)}


def refused_changes(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    """The keys of ``changes`` that need ``train.allow_config_change``: the model's function and the data order."""
    return [k for k in changes if (k.startswith("model.") and k not in HOW_COMPUTED) or k in DATA_ORDER]


def shown(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def check_change(workdir: Path, resumed_from: int, trained: ConfigDict, config: ConfigDict) -> dict:
    """The changes from ``trained`` (the config checkpoint ``resumed_from`` was trained with) to ``config``;
    :class:`ConfigChangeRefused` for one that needs ``train.allow_config_change`` and does not have it."""
    changes = diff(trained, config)
    refused = refused_changes(changes)
    if refused and not config.train.allow_config_change:
        why = [w for w, keys in (("what the trained model computes", [k for k in refused if k.startswith("model.")]),
                                 ("the order of its data", [k for k in refused if k in DATA_ORDER])) if keys]
        raise ConfigChangeRefused(
            f"resuming {workdir} at step {resumed_from} with {', '.join(refused)} changed ({shown(changes)}) would "
            f"change {' and '.join(why)}; rerun with the saved config (hybrid_jax.checkpoints.read_config), use a new "
            "train.workdir, or pass --config.train.allow_config_change=true to change it anyway")
    return changes


def repair_start(workdir: Path, saved: str | None, log: Callable[[str], None]) -> None:
    """Make sure ``config.json`` holds a readable config: an unreadable one is moved to the quarantine folder and,
    like a missing one, rebuilt from ``saved`` (the oldest checkpoint's copy) with a note."""
    path = workdir / CONFIG
    if path.is_file():
        try:
            parse(path.read_text(), path)
            return
        except (ConfigUnreadable, OSError) as e:
            if saved is None:
                raise ConfigUnreadable(f"{e}; move it away or restore it (no checkpoint holds a copy)") from None
            from hybrid_jax.checkpoints.integrity import quarantine

            moved = quarantine(workdir, path, f"unreadable ({e})")
            log(f"note: {path} is unreadable: moved to {moved}")
    elif saved is None:
        return
    path.write_text(saved)
    log(f"note: rebuilt {path} from the oldest checkpoint's copy of its config")


def record(workdir: Path, config: ConfigDict, resumed_from: int | None, changes: dict,
           log: Callable[[str], None] = print) -> None:
    """Save ``config`` into the history of ``workdir``: ``config.json`` for a new run, ``config-STEP.json`` when a
    run resumed from ``resumed_from`` with ``changes`` (:func:`check_change`)."""
    if resumed_from is None:
        (workdir / CONFIG).write_text(to_json(config))
        return
    if not changes:
        return
    first = resumed_from + 1
    path = workdir / f"config-{first}.json"
    path.write_text(to_json(config))
    log(f"config changed from step {first} (saved as {path.name}; config.json keeps the start): {shown(changes)}")


def set_aside_after(workdir: Path, step: int) -> list[Path]:
    """Move the ``config-STEP.json`` of steps after ``step`` (a rewound timeline) into the quarantine folder."""
    moved = []
    for first, path in config_history(workdir):
        if first > step and path.name != CONFIG:
            folder = workdir / QUARANTINE
            folder.mkdir(parents=True, exist_ok=True)
            moved.append(Path(shutil.move(str(path), str(folder / path.name))))
    return moved
