"""Checkpoint saves that fail, told in one line naming the folder: not writable, full, or gone."""

from __future__ import annotations

import errno
import os
from pathlib import Path

_CAUSES = {
    errno.EACCES: "is not writable", errno.EPERM: "is not writable", errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "is full (no space left on the device)", errno.EDQUOT: "is over its disk quota",
    errno.ENOENT: "was removed", errno.ENOTDIR: "is not a folder", errno.EEXIST: "is not a folder",
}
_PATTERNS = {  # the same, as TensorStore / Orbax word them in their own exceptions
    "Permission denied": "is not writable", "PERMISSION_DENIED": "is not writable",
    "Read-only file system": "is on a read-only file system", "No space left": "is full (no space left on the device)",
    "Disk quota exceeded": "is over its disk quota",
}
_ADVICE = "free space or fix its permissions, or set train.workdir to another folder; the run can then be resumed"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message names the folder and what to do."""


def check_writable(directory: Path) -> None:
    """Create ``directory`` and write a probe file in it; a :class:`CheckpointSaveError` if that fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as e:
        cause = _CAUSES.get(e.errno, f"cannot be written ({e.strerror})")
        raise CheckpointSaveError(_message(directory, None, cause)) from None


def _chain(e: BaseException):
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        stack += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]


def cause_of(e: BaseException) -> str | None:
    """Why a save failed, when it is the storage's fault (a phrase), else None."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _CAUSES:
            return _CAUSES[x.errno]
        for pattern, cause in _PATTERNS.items():
            if pattern in str(x):
                return cause
    return None


def _message(directory: Path, step: int | None, cause: str) -> str:
    at = f"saving the checkpoint of step {step}: " if step is not None else ""
    return f"{at}checkpoint folder {directory} {cause}; {_ADVICE}"


def save_error(e: BaseException, directory: Path, step: int | None) -> CheckpointSaveError | None:
    """The one-line error for a failed save, or None when ``e`` is not a storage problem (then re-raise it)."""
    cause = cause_of(e)
    if cause is None and not directory.is_dir():
        cause = _CAUSES[errno.ENOENT]
    if cause is None:
        try:
            check_writable(directory)
        except CheckpointSaveError as probe:
            return CheckpointSaveError(f"saving the checkpoint of step {step}: {probe}" if step else str(probe))
        return None
    return CheckpointSaveError(_message(directory, step, cause))
