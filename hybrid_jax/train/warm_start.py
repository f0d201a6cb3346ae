"""A run that starts from given weights: a step-0 checkpoint of those parameters with a fresh optimizer state.

``write_workdir(config, params, workdir)`` is what ``hybrid_jax.export.imports`` writes an imported checkpoint with;
training ``config`` in ``workdir`` then resumes from it, i.e. starts from those weights.
"""

from __future__ import annotations

from pathlib import Path

import jax
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import Checkpointer
from hybrid_jax.checkpoints.layout import CONFIG, saved_steps
from hybrid_jax.config import to_json
from hybrid_jax.train.trainer import build_trainer


def _dotted(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def write_workdir(config: ConfigDict, params: dict, workdir: str | Path) -> None:
    """A fresh run directory whose step-0 checkpoint holds ``params`` (flat dict) and a fresh optimizer state; the
    trainer resumes from it with ``config`` (``config.train.workdir`` is set to ``workdir``)."""
    config.train.workdir = str(workdir)
    workdir = Path(workdir)
    if saved_steps(workdir):
        raise FileExistsError(f"{workdir / 'checkpoints'} already holds checkpoints; import into an empty workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(config, jax.devices()[:1])  # the state's values only: any mesh restores them
    state = trainer.state
    imported = jax.tree_util.tree_map_with_path(lambda p, x: params[_dotted(p)].astype(x.dtype), state["params"])
    state["params"] = jax.device_put(imported, trainer.shardings["params"])
    checkpointer = Checkpointer(workdir, config)
    try:
        checkpointer.save(0, state, dict(sequences=0, seq_len=config.train.seq_len, seed=config.train.seed),
                          force=True)
        checkpointer.wait()
    finally:
        checkpointer.close()
    (workdir / CONFIG).write_text(to_json(config))
