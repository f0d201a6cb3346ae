"""A run's directory and checkpoints, both halves: reading (``hybrid_jax.load``, verified restores) and writing
(saves, the keep policy, integrity, quarantine), and the workdir itself (lock, restore step, config history).

Modules, one concern each::

    layout.py     the names of a run directory (the tree is drawn there)
    integrity.py  checksums, health and config of each step; quarantine
    reader.py     verified restores, shape checks, load (imports nothing of hybrid_jax.train)
    writer.py     Checkpointer: async saves, the keep policy, save errors
    storage.py    storage faults as one line (not writable, full, read-only)
    lock.py       one run per workdir
    history.py    config.json and config-STEP.json: the config as it changed
    resume.py     which checkpoint a run continues from (its own, or another run's: train.branch_from), decided
                  before anything moves
"""

from hybrid_jax.checkpoints.history import ConfigChangeRefused, ConfigUnreadable, config_history, read_config
from hybrid_jax.checkpoints.layout import checkpoint_dir
from hybrid_jax.checkpoints.lock import WorkdirLock, WorkdirLocked
from hybrid_jax.checkpoints.reader import (
                                           CheckpointDamaged,
                                           CheckpointMismatch,
                                           CheckpointReader,
                                           check_shapes,
                                           latest_step,
                                           load,
                                           trained_config,
)
from hybrid_jax.checkpoints.resume import NoUsableCheckpoint, ResumePlan, carry_out, plan_branch, plan_resume
from hybrid_jax.checkpoints.storage import CheckpointSaveError, StorageError
from hybrid_jax.checkpoints.writer import Checkpointer

# what a run's workdir can refuse, each in one line that says what to do (the CLI prints them as "error: ...")
RUN_ERRORS = (WorkdirLocked, NoUsableCheckpoint, ConfigChangeRefused, ConfigUnreadable, StorageError,
              CheckpointMismatch, CheckpointDamaged)

__all__ = ["RUN_ERRORS", "CheckpointDamaged", "CheckpointMismatch", "CheckpointReader", "CheckpointSaveError",
           "Checkpointer", "ConfigChangeRefused", "ConfigUnreadable", "NoUsableCheckpoint", "ResumePlan",
           "StorageError", "WorkdirLock", "WorkdirLocked", "carry_out", "check_shapes", "checkpoint_dir",
           "config_history", "latest_step", "load", "plan_branch", "plan_resume", "read_config", "trained_config"]
