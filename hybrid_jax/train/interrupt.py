"""Ctrl-C (SIGINT) and preemption (SIGTERM, e.g. SLURM's before a time limit or a requeue) lose nothing.

While :class:`StopRequests` is active, the first signal only raises a flag: the trainer finishes the step in
flight, saves a checkpoint of it, waits for the save and stops with :class:`Interrupted` (the CLI prints one line
and exits with ``128 + signal``: 130 for SIGINT, 143 for SIGTERM). A second signal aborts at once (exit status
``128 + signal``, no traceback); a save that was cut short is never seen, Orbax only publishes complete steps.

With several processes all of them must stop after the same step. SIGTERM is then left to JAX's preemption
service (``jax.distributed`` catches it on every process and agrees on a step), read through Orbax's
``CheckpointManager.reached_preemption``; a local Ctrl-C is shared with the other processes at each log point
(an all-gather of one flag, where the host already waits for the metrics).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import jax
import numpy as np

EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(Exception):  # noqa: N818 (a request, not an error)
    """The run stopped on a signal after saving a checkpoint at ``step``."""

    def __init__(self, step: int, signum: int, workdir: str):
        self.step, self.signum, self.workdir = step, signum, workdir
        name = signal.Signals(signum).name
        super().__init__(f"{name}: interrupted at step {step}; checkpoint saved in {workdir}; "
                         "rerun the same command to resume")

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 128 + self.signum)


class StopRequests:
    """A context manager: SIGINT/SIGTERM handlers that turn the first signal into a stop request."""

    def __init__(self, *, say=print):
        self.signum: int | None = None
        self.say = say
        self.multiprocess = jax.process_count() > 1
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        signums = (signal.SIGINT,) if self.multiprocess else (signal.SIGINT, signal.SIGTERM)
        for s in signums:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: abort now
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: aborting without saving\n")
            sys.stderr.flush()
            os._exit(EXIT_STATUS.get(signum, 128 + signum))
        self.signum = signum
        self.say(f"{signal.Signals(signum).name}: finishing the step in flight and saving a checkpoint "
                 "(press Ctrl-C again to abort at once)")

    def should_stop(self, step: int, *, log_point: bool, manager=None) -> bool:
        """Whether every process stops after ``step`` (collective with several processes at log points)."""
        if not self.multiprocess:
            return self.signum is not None
        if manager is not None and manager.reached_preemption(step):
            self.signum = self.signum or signal.SIGTERM
            return True
        if not log_point:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.signum or 0))
        if np.any(flags):
            self.signum = self.signum or int(np.max(flags))
            return True
        return False
