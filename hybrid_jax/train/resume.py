"""Opening a run's workdir: the lock, the checkpointer, the checkpoint to resume from, the config history.

``train.restore_step=S`` resumes from checkpoint ``S`` instead of the newest (e.g. from before a divergence):
the newer checkpoints and the ``config-STEP.json`` of later steps are moved to
``WORKDIR/checkpoints-quarantine/`` (kept, never deleted), and ``WORKDIR/restore_step.json`` records that it was
done, so that relaunching the same command later resumes from the newest checkpoint again instead of rewinding
a second time (delete that file to rewind to the same step again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import grain
import jax
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import CheckpointMismatch
from hybrid_jax.train import config_history, integrity
from hybrid_jax.train.checkpoint import Checkpointer, CheckpointSaveError, NoUsableCheckpoint
from hybrid_jax.train.lock import WorkdirLock, WorkdirLocked

RESTORED = "restore_step.json"
# what a run's workdir can refuse, each in one line that says what to do (the CLI prints them as "error: ...")
RUN_ERRORS = (WorkdirLocked, NoUsableCheckpoint, config_history.ConfigChangeRefused, CheckpointSaveError,
              CheckpointMismatch)


def open_run(workdir: Path, train_cfg: ConfigDict, log: Callable[[str], None]) -> tuple[Checkpointer, WorkdirLock]:
    """Take the workdir's lock (process 0), then open its checkpoints; the lock is released if that fails."""
    lock = WorkdirLock(workdir)
    if jax.process_index() == 0:
        lock.acquire(log)
    try:
        return Checkpointer(workdir, train_cfg), lock
    except BaseException:
        lock.release()
        raise


def _already_rewound(workdir: Path, step: int, newest: int | None) -> bool:
    try:
        done = json.loads((workdir / RESTORED).read_text())
    except (OSError, ValueError):
        return False
    return done.get("restore_step") == step and newest is not None and newest > step


def resume(ckpt: Checkpointer, config: ConfigDict, abstract_state: dict, data_iter: grain.DatasetIterator,
           log: Callable[[str], None]) -> dict | None:
    """The state to continue from (the iterator moved to its position), or None for a fresh run; the config is
    recorded in the workdir's history either way (see :mod:`hybrid_jax.train.config_history`)."""
    workdir, step = ckpt.workdir, config.train.restore_step or None
    if step is not None and _already_rewound(workdir, step, ckpt.latest_step()):
        log(f"note: train.restore_step={step} was applied already (see {workdir / RESTORED}); resuming from the "
            f"newest checkpoint, step {ckpt.latest_step()}")
        step = None
    found = ckpt.resume(abstract_state, data_iter, step=step, log=log)
    if step is not None:
        moved = ckpt.set_aside_after(step, f"newer than train.restore_step={step}", log)
    if found is not None and jax.process_index() == 0:  # configs of steps no kept checkpoint was trained with
        for path in config_history.set_aside_after(workdir, found[1], workdir / integrity.QUARANTINE):
            log(f"{path.name} set aside (after the checkpoint resumed from, step {found[1]}): moved to {path}")
    if step is not None:
        if jax.process_index() == 0:
            record = dict(restore_step=step, set_aside=moved, time=time.strftime("%Y-%m-%d %H:%M:%S"))
            (workdir / RESTORED).write_text(json.dumps(record) + "\n")
    if found is not None:
        log(f"resuming from {ckpt.directory} step {found[1]}")
    config_history.record(workdir, config, None if found is None else found[1], log, write=jax.process_index() == 0)
    return None if found is None else found[0]
