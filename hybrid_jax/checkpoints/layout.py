"""The names of a run directory (``train.workdir``), in one place::

    WORKDIR/
      config.json                the config the run started with
      config-STEP.json           each change a resumed run made, in effect from STEP
      train.lock                 the run that holds the workdir (host, pid, start time)
      restore_step.json          a train.restore_step that was applied (so a relaunch does not rewind again)
      branched_from.json         the checkpoint a train.branch_from run started from (workdir, step)
      metrics.jsonl              one JSON line per logged step (and per validation)
      tensorboard/               TensorBoard events
      checkpoints/<step>/        one Orbax checkpoint: state/ (train state), data/ (data position),
                                 integrity.json (size and SHA-256 of every file, the step's health and config)
      checkpoints-quarantine/    checkpoints and configs set aside (never deleted), README.txt says why
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"
CONFIG = "config.json"
LOCK = "train.lock"
RESTORED = "restore_step.json"
BRANCHED = "branched_from.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
QUARANTINE = "checkpoints-quarantine"


def checkpoint_dir(workdir: str | Path) -> Path:
    """``WORKDIR/checkpoints`` (absolute)."""
    return Path(workdir).resolve() / CHECKPOINTS


def step_dir(workdir: str | Path, step: int) -> Path:
    """``WORKDIR/checkpoints/<step>`` (absolute)."""
    return checkpoint_dir(workdir) / str(step)


def saved_steps(workdir: str | Path) -> list[int]:
    """The complete checkpoint steps on disk, oldest first (Orbax names a step's folder by its number once the save
    is complete; a save in flight is ``<step>.orbax-checkpoint-tmp-*``)."""
    folder = checkpoint_dir(workdir)
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
