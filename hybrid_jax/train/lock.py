"""One run per workdir: ``WORKDIR/train.lock`` names the holder (host, pid, start time).

The lock is a file created exclusively (``O_CREAT | O_EXCL``) by process 0 of a run and removed when the run
ends. A second run on the workdir refuses in one line naming the holder. A lock left by a process that no
longer exists on this host (a killed run) is taken over with a note; one held from another host cannot be
checked from here, so the message says how to remove it once that run is known to be gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOCK = "train.lock"


class WorkdirLocked(RuntimeError):
    """Another run holds the workdir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


class WorkdirLock:
    """Hold ``WORKDIR/train.lock`` for the life of a run: :meth:`acquire`, then :meth:`release`."""

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK
        self.me = dict(host=socket.gethostname(), pid=os.getpid(), started=time.strftime("%Y-%m-%d %H:%M:%S"))
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
        return True

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def acquire(self, log: Callable[[str], None] = print) -> None:
        """Take the lock; :class:`WorkdirLocked` when a live run holds it; a dead holder's lock is taken over."""
        for _ in range(3):  # a lock removed or replaced between the checks is looked at again
            if self._create():
                self.held = True
                return
            holder = self._holder()
            if not holder:  # being written by its creator right now, or garbled
                time.sleep(0.2)
                holder = self._holder()
            same_host = holder.get("host") == self.me["host"]
            pid = holder.get("pid")
            mine = same_host and pid == self.me["pid"]
            if holder and not mine and (not same_host or (isinstance(pid, int) and _alive(pid))):
                where = "" if same_host else f" (it cannot be checked from {self.me['host']}; if that run is gone, " \
                                             f"delete {self.path})"
                raise WorkdirLocked(f"{self.path.parent} is in use by another run ({_describe(holder)}){where}; "
                                    "wait for it to end or choose another train.workdir")
            if self._holder() != holder:
                continue
            self.path.unlink(missing_ok=True)
            if holder and not mine:
                log(f"note: took over the lock of a run that no longer exists ({_describe(holder)})")
        raise WorkdirLocked(f"could not take {self.path}: other runs keep replacing it; choose another train.workdir")

    def release(self) -> None:
        """Remove the lock file if this run holds it."""
        if self.held and self._holder().get("pid") == self.me["pid"]:
            self.path.unlink(missing_ok=True)
        self.held = False
