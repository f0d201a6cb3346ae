"""Checkpoint integrity: a SHA-256 per file, the step's health and its config, written when a save is complete,
checked before any read.

Each step folder ``WORKDIR/checkpoints/<step>/`` gets, in Orbax's post-finalization hook (inside the step's
temporary folder, just before Orbax renames it into place, so a visible step folder always carries them):

* ``config.json``: the run config the step was trained with (so a damaged or deleted ``WORKDIR/config.json`` can be
  rebuilt from the newest checkpoint);
* ``integrity.json``: ``{"files": {path: {"size", "sha256"}}, "health": {"skipped_in_a_row": N}}``, every file of the
  step (``config.json`` included) and how many steps in a row had been skipped when it was saved (0: healthy; the
  keep policy reads it from here, see :mod:`hybrid_jax.checkpoints.writer`).

Every checkpoint this trainer writes has both, so a missing ``integrity.json`` is damage like a changed byte.
A checkpoint that fails is moved aside, never deleted, by :func:`quarantine` into ``WORKDIR/checkpoints-quarantine/``
with one line in its ``README.txt`` naming what and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from hybrid_jax.checkpoints.layout import CONFIG, QUARANTINE

MANIFEST = "integrity.json"
# Orbax rewrites the step's own metadata after the hook (the commit time): listed, checked to exist and parse.
REWRITTEN = frozenset({"_CHECKPOINT_METADATA"})


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_manifest(step_dir: Path, *, skipped_in_a_row: int, config_json: str) -> None:
    """Write the step's ``config.json``, then ``integrity.json``: size and SHA-256 of every file under ``step_dir``
    and the step's health."""
    _write_atomically(step_dir / CONFIG, config_json)
    files = {}
    for p in _files(step_dir):
        name = str(p.relative_to(step_dir))
        files[name] = dict(size=None, sha256=None) if name in REWRITTEN else dict(size=p.stat().st_size,
                                                                                  sha256=file_sha256(p))
    manifest = dict(algorithm="sha256", files=files, health=dict(skipped_in_a_row=int(skipped_in_a_row)))
    _write_atomically(step_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def _manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / MANIFEST).read_text())


def skipped_in_a_row(step_dir: Path) -> int | None:
    """The health saved with the step (0: healthy), or None when its manifest cannot be read."""
    try:
        return int(_manifest(step_dir)["health"]["skipped_in_a_row"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_config(step_dir: Path) -> str:
    """The text of the config the step was trained with (``<step>/config.json``); OSError when it has none."""
    return (step_dir / CONFIG).read_text()


def verify(step_dir: Path) -> str | None:
    """Why ``step_dir`` fails its checks (a short phrase), or None when every file matches its manifest."""
    if not (step_dir / MANIFEST).is_file():
        return f"it has no {MANIFEST} (every checkpoint this trainer writes has one)"
    try:
        files = _manifest(step_dir)["files"]
        items = sorted(files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for name, want in items:
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if want["sha256"] is None:
            try:
                json.loads(path.read_text())
            except (OSError, ValueError):
                return f"{name} is not readable JSON"
            continue
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
        if file_sha256(path) != want["sha256"]:
            return f"{name} does not match its SHA-256 (the data changed after it was written)"
    return None


def quarantine(workdir: Path, path: Path, reason: str) -> Path:
    """Move ``path`` (a step folder or a config file) into ``WORKDIR/checkpoints-quarantine/`` (never deleted) and
    note why in its ``README.txt``; returns the new path."""
    folder = workdir / QUARANTINE
    folder.mkdir(parents=True, exist_ok=True)
    target, n = folder / path.name, 1
    while target.exists():
        target, n = folder / f"{path.name}.{n}", n + 1
    shutil.move(str(path), str(target))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    what = f"checkpoint step {path.name}" if path.name.isdigit() else path.name
    with open(folder / "README.txt", "a") as f:
        f.write(f"{stamp} {socket.gethostname()}: {what} -> {target.name}: {reason}\n")
    return target
