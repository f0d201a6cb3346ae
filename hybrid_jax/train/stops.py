"""How a run stops other than by finishing: a signal, too many skipped steps, device out-of-memory.

Ctrl-C (SIGINT) and preemption (SIGTERM, e.g. SLURM's before a time limit or a requeue) lose nothing.

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
import threading
from types import FrameType

import numpy as np
from ml_collections import ConfigDict

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


# Ctrl-C seen by a thread of its own (:func:`watch_signals`): the main thread runs Python signal handlers only
# between bytecodes, never inside a long native call (building the model, compiling the step).
_watch = {"on": False, "training": False, "count": 0}


def watch_signals() -> None:
    """Call first in a command's main (main thread): from then on Ctrl-C is answered at once, also while the main
    thread is inside a long native call. The first says what happens next (before training: the command stops as
    soon as the call returns; while training: the step in flight is finished and saved), the second aborts at once
    (exit 130)."""
    if _watch["on"]:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _watch["on"] = True
    threading.Thread(target=_watch_loop, args=(read,), daemon=True, name="signal-watch").start()


def _say(text: str) -> None:
    sys.stderr.write(f"\n{text}\n")
    sys.stderr.flush()


def _watch_loop(fd: int) -> None:
    while True:
        for signum in os.read(fd, 64):
            if signum != signal.SIGINT:
                continue
            _watch["count"] += 1
            if _watch["count"] >= 2:
                _say("SIGINT again: aborting without saving")
                os._exit(EXIT_STATUS[signal.SIGINT])
            _say("SIGINT: finishing the step in flight and saving a checkpoint (press Ctrl-C again to abort at once)"
                 if _watch["training"] else
                 "SIGINT: stopping as soon as the current start-up work returns; nothing has been trained, nothing "
                 "to save (press Ctrl-C again to abort at once)")


class StopRequests:
    """A context manager: SIGINT/SIGTERM handlers that turn the first signal into a stop request."""

    def __init__(self, *, say=print):
        self.signum: int | None = None
        self.say = say
        import jax

        self.multiprocess = jax.process_count() > 1
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        signums = (signal.SIGINT,) if self.multiprocess else (signal.SIGINT, signal.SIGTERM)
        for s in signums:
            self._old[s] = signal.signal(s, self._handle)
        _watch.update(training=True, count=0)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()
        _watch["training"] = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: abort now
            _say(f"{signal.Signals(signum).name} again: aborting without saving")
            os._exit(EXIT_STATUS.get(signum, 128 + signum))
        self.signum = signum
        if not (_watch["on"] and signum == signal.SIGINT):  # the watcher has said it already
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


class TooManySkippedSteps(RuntimeError):
    """``train.max_skipped_in_a_row`` consecutive steps had a non-finite loss, gradient or update."""


def check_skipped(step: int, metrics: dict, limit: int, warn) -> None:
    """Warn about a skipped ``step`` (its host ``metrics``); :class:`TooManySkippedSteps` at ``limit`` in a row."""
    if bool(metrics["finite"]):
        return
    in_a_row = int(metrics["skipped_in_a_row"])
    warn(f"step {step}: non-finite loss, gradient or update, update skipped ({in_a_row} in a row, "
         f"{int(metrics['skipped'])} in total)")
    if in_a_row >= limit:
        raise TooManySkippedSteps(
            f"stopping: {in_a_row} steps in a row had a non-finite loss, gradient or update "
            f"(train.max_skipped_in_a_row={limit}); lower train.lr, check the data, or restart from an earlier "
            "checkpoint with --config.train.restore_step=STEP"
        )


# --- device out-of-memory: XLA reports it as ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate ...`` (at
# run time) or as a compile that exceeds the device's memory; it becomes one line naming the knobs to turn.

def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA's device out-of-memory (any backend: the text, not the exception type)."""
    text = str(error).lower()
    return "resource_exhausted" in text or "out of memory" in text


def _first_line(error: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:limit]


def out_of_memory_message(error: BaseException, config: ConfigDict, n_devices: int) -> str | None:
    """The one line for an out-of-memory ``error`` of a run of ``config`` on ``n_devices``; None for another
    error. The knobs, each only when it can still be turned: a smaller ``train.micro_batch_size`` (the global
    batch is kept by accumulation), ``model.remat=full``, ``mesh.fsdp`` over more devices (weights, gradients and
    moments split, ZeRO-3), ``train.zero1`` (moments split over ``data``)."""
    if not is_out_of_memory(error):
        return None
    from hybrid_jax.train.step import mesh as mesh_lib

    t = config.train
    try:
        data, fsdp, _ = mesh_lib.mesh_shape(config.mesh, n_devices)
    except ValueError:
        data, fsdp = n_devices, config.mesh.fsdp
    knobs = []
    if t.micro_batch_size > 1:
        knobs.append(f"a smaller train.micro_batch_size (now {t.micro_batch_size}; the global batch is kept by "
                     "accumulation)")
    if config.model.remat != "full":
        knobs.append(f"model.remat=full (now {config.model.remat})")
    if fsdp < n_devices:
        knobs.append(f"mesh.fsdp={min(n_devices, 2 * fsdp)} or more (now {fsdp}: splits weights and moments)")
    else:
        knobs.append(f"more GPUs, with mesh.fsdp over all of them (now {fsdp} of {n_devices})")
    if not t.zero1 and data > 1:
        knobs.append("train.zero1=true")
    return (f"out of device memory ({_first_line(error)}) at micro batch {t.micro_batch_size} x {t.seq_len}, "
            f"remat {config.model.remat}, mesh data {data} x fsdp {fsdp}, zero1 {t.zero1}; try "
            f"{', then '.join(knobs)} "
            "(python -m benchmarks plan_memory --config CONFIG --fsdp N plans the memory per device)")
