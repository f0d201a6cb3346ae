"""A run that starts from given weights: a step-0 checkpoint of those parameters with a fresh optimizer state.

``write_workdir(config, params, workdir)`` is what ``hybrid_jax.export.import_fla`` writes an FLA checkpoint with;
training ``config`` in ``workdir`` then resumes from it, i.e. starts from those weights.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import to_json
from hybrid_jax.data import make_train_iterator
from hybrid_jax.model import HybridLM
from hybrid_jax.train import mesh as mesh_lib
from hybrid_jax.train.checkpoint import Checkpointer
from hybrid_jax.train.optim import make_optimizer
from hybrid_jax.train.step import init_state


def _dotted(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def write_workdir(config: ConfigDict, params: dict, workdir: str | Path) -> None:
    """A fresh run directory whose step-0 checkpoint holds ``params`` (flat dict) and a fresh optimizer state; the
    trainer resumes from it with ``config`` (``config.train.workdir`` is set to ``workdir``)."""
    config.train.workdir = str(workdir)
    workdir = Path(workdir)
    if (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir()):
        raise FileExistsError(f"{workdir / 'checkpoints'} already holds checkpoints; import into an empty workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    t = config.train
    mesh = mesh_lib.make_mesh(config.mesh)
    _, state, shardings = init_state(lambda: HybridLM(config.model, rngs=nnx.Rngs(t.seed)), make_optimizer(t), mesh,
                                     zero1=t.zero1, seed=t.seed)
    imported = jax.tree_util.tree_map_with_path(lambda p, x: params[_dotted(p)].astype(x.dtype), state["params"])
    state["params"] = jax.device_put(imported, shardings["params"])
    data_iter = make_train_iterator(config, process_index=jax.process_index(), process_count=jax.process_count())
    checkpointer = Checkpointer(workdir, t)
    try:
        checkpointer.save(0, state, data_iter, force=True)
        checkpointer.wait()
    finally:
        checkpointer.close()
    (workdir / "config.json").write_text(to_json(config))
