"""One run per workdir: ``WORKDIR/train.lock``, held with an exclusive ``flock`` for the life of the run.

The kernel holds the lock, not the file: when the run ends in any way (``kill -9`` included) its lock is released,
so a lock is never stale and a relaunch (on another node too, on a shared file system with locks) takes it at once.
The file names the holder (host, pid, start time) for the message a second run gets. Taking over a dead run's file
says so in one line.

On a file system without ``flock`` (some Lustre mounts) the lock is the file itself, created exclusively; a file
left by a dead process of this host (the pid is gone, or now belongs to another process: the start time differs) is
taken over, one from another host cannot be checked from here and the message says how to remove it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from hybrid_jax.checkpoints.layout import LOCK
from hybrid_jax.checkpoints.storage import storage_error

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class WorkdirLocked(RuntimeError):
    """Another run holds the workdir."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot; None when unknown)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the holder's process still runs (this host only): its pid exists with the same start time."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    started = holder.get("pid_start")
    return started is None or _start_time(pid) in (None, started)


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


class WorkdirLock:
    """Hold ``WORKDIR/train.lock``: :meth:`acquire`, then :meth:`release`."""

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK
        pid = os.getpid()
        self.me = dict(host=socket.gethostname(), pid=pid, pid_start=_start_time(pid),
                       started=time.strftime("%Y-%m-%d %H:%M:%S"))
        self._fd: int | None = None
        self.held = False

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _refuse(self, holder: dict, checkable: bool) -> WorkdirLocked:
        where = "" if checkable else (f" (it cannot be checked from {self.me['host']}; if that run is gone, delete "
                                      f"{self.path})")
        return WorkdirLocked(f"{self.path.parent} is in use by another run ({_describe(holder)}){where}; wait for it "
                             "to end or choose another train.workdir")

    def acquire(self, log: Callable[[str], None] = print) -> None:
        """Take the lock; :class:`WorkdirLocked` when a live run holds it; a storage fault is one line."""
        try:
            self._acquire(log)
        except OSError as e:
            self.release()
            if (error := storage_error(e, self.path, "the workdir's lock")) is None:
                raise
            raise error from None

    def _acquire(self, log: Callable[[str], None]) -> None:
        for _ in range(10):  # a file unlinked or replaced between the open and the lock is opened again
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse(self._holder(), checkable=True) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_FLOCK:
                    raise
                return self._acquire_exclusive(log)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._fd, self.held = fd, True  # ours from here: a failed write below removes the file
            previous = self._holder()
            self._write(fd)
            if previous:
                log(f"note: took over the lock of a run that has ended ({_describe(previous)})")
            return
        raise WorkdirLocked(f"could not take {self.path}: other runs keep replacing it; choose another train.workdir")

    def _write(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.me).encode(), 0)
        os.fsync(fd)

    def _acquire_exclusive(self, log: Callable[[str], None]) -> None:
        """The lock as a file created exclusively (no ``flock`` on this file system)."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                holder = self._holder()
                same_host = holder.get("host") == self.me["host"]
                if holder and (not same_host or _alive(holder)):
                    raise self._refuse(holder, checkable=same_host) from None
                self.path.unlink(missing_ok=True)
                log(f"note: took over the lock of a run that has ended ({_describe(holder)})")
                continue
            self._fd, self.held = fd, True
            self._write(fd)
            return
        raise WorkdirLocked(f"could not take {self.path}: other runs keep replacing it; choose another train.workdir")

    def release(self) -> None:
        """Remove the lock file and let go (a no-op when this run does not hold it)."""
        if self._fd is not None:
            if self.held:
                try:
                    self.path.unlink(missing_ok=True)
                except OSError:
                    pass
            os.close(self._fd)
        self._fd, self.held = None, False
