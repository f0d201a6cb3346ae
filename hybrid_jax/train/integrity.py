"""Checkpoint integrity: a SHA-256 per file, written when a save is complete, checked before a restore.

Each step folder ``WORKDIR/checkpoints/<step>/`` gets ``integrity.json`` (``{"files": {path: {"size", "sha256"}}}``)
once Orbax has finished writing it: :func:`write_manifest` runs in Orbax's post-finalization hook, inside the
step's temporary folder, just before Orbax renames it into place, so a visible step folder always carries its
manifest (a folder written before this existed has none and is restored unverified, with a note).

A checkpoint that fails (a file missing, resized or changed, unreadable metadata, a restore error, a
non-finite value) is moved aside, never deleted, by :func:`quarantine` into ``WORKDIR/checkpoints-quarantine/``
with one line in its ``README.txt`` naming the step and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

MANIFEST = "integrity.json"
# Orbax rewrites the step's own metadata after the hook (the commit time): listed, checked to exist and parse.
REWRITTEN = frozenset({"_CHECKPOINT_METADATA"})
QUARANTINE = "checkpoints-quarantine"  # WORKDIR/checkpoints-quarantine/<step>[.N]/ and README.txt
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> None:
    """Write ``step_dir/integrity.json``: size and SHA-256 of every file under ``step_dir`` (atomically)."""
    files = {}
    for p in _files(step_dir):
        name = str(p.relative_to(step_dir))
        files[name] = dict(size=None, sha256=None) if name in REWRITTEN else dict(size=p.stat().st_size,
                                                                                  sha256=file_sha256(p))
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(dict(algorithm="sha256", files=files), indent=1, sort_keys=True))
    os.replace(tmp, step_dir / MANIFEST)


def has_manifest(step_dir: Path) -> bool:
    return (step_dir / MANIFEST).is_file()


def verify(step_dir: Path) -> str | None:
    """Why ``step_dir`` fails its manifest (a short phrase), or None when every listed file matches."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for name, want in sorted(files.items()):
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


def quarantine(workdir: Path, step_dir: Path, reason: str) -> Path:
    """Move ``step_dir`` into ``WORKDIR/checkpoints-quarantine/`` (never deleted) and note why; returns the new path."""
    folder = workdir / QUARANTINE
    folder.mkdir(parents=True, exist_ok=True)
    target, n = folder / step_dir.name, 1
    while target.exists():
        target, n = folder / f"{step_dir.name}.{n}", n + 1
    shutil.move(str(step_dir), str(target))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(folder / "README.txt", "a") as f:
        f.write(f"{stamp} {socket.gethostname()}: checkpoint step {step_dir.name} -> {target.name}: {reason}\n")
    return target
