"""Storage faults of a run's workdir (not writable, full, read-only, gone), told in one line that names the path
and what to do, wherever they happen: creating the workdir, taking its lock, the metrics files, a checkpoint save
(in Orbax's background thread too)."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_CAUSES = {
    errno.EACCES: "is not writable", errno.EPERM: "is not writable", errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "is full (no space left on the device)", errno.EDQUOT: "is over its disk quota",
    errno.ENOENT: "was removed", errno.ENOTDIR: "is not a folder", errno.EEXIST: "is not a folder",
    errno.EFBIG: "is full (the file size limit was reached)",
}
_PATTERNS = {  # the same, as TensorStore / Orbax word them in their own exceptions
    "Permission denied": "is not writable", "PERMISSION_DENIED": "is not writable",
    "Read-only file system": "is on a read-only file system", "No space left": "is full (no space left on the device)",
    "Disk quota exceeded": "is over its disk quota", "File too large": "is full (the file size limit was reached)",
}
_ADVICE = "free space or fix its permissions, or set train.workdir to another folder; the run can then be resumed"


class StorageError(RuntimeError):
    """A file or folder of the run could not be written; the message names it and what to do."""


class CheckpointSaveError(StorageError):
    """A checkpoint could not be written."""


def check_writable(directory: Path, what: str = "checkpoint folder") -> None:
    """Create ``directory`` and write a probe file in it (a fresh name, never through a link); a
    :class:`StorageError` naming ``what`` if that fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        cause = _CAUSES.get(e.errno, f"cannot be written ({e.strerror})")
        raise (CheckpointSaveError if what == "checkpoint folder" else StorageError)(
            f"{what} {directory} {cause}; {_ADVICE}") from None


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        stack += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]


def cause_of(e: BaseException) -> str | None:
    """Why a write failed, when it is the storage's fault (a phrase), else None."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _CAUSES:
            return _CAUSES[x.errno]
        for pattern, cause in _PATTERNS.items():
            if pattern in str(x):
                return cause
    return None


def storage_error(e: BaseException, path: Path, what: str) -> StorageError | None:
    """The one-line error for ``e`` raised while writing ``what`` at ``path``, or None when ``e`` is not a storage
    problem (then re-raise it)."""
    cause = cause_of(e)
    return None if cause is None else StorageError(f"{what} {path} {cause}; {_ADVICE}")


def save_error(e: BaseException, directory: Path, step: int | None) -> CheckpointSaveError | None:
    """The one-line error for a failed checkpoint save, or None when ``e`` is not a storage problem."""
    cause = cause_of(e)
    if cause is None and not directory.is_dir():
        cause = _CAUSES[errno.ENOENT]
    at = f"saving the checkpoint of step {step}: " if step is not None else ""
    if cause is None:
        try:
            check_writable(directory)
        except CheckpointSaveError as probe:
            return CheckpointSaveError(f"{at}{probe}")
        return None
    return CheckpointSaveError(f"{at}checkpoint folder {directory} {cause}; {_ADVICE}")
