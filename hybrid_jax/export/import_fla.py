"""Import an FLA-format checkpoint (``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM``: config.json + safetensors).

``import_fla(fla_dir, workdir, config=None)`` writes a step-0 checkpoint of the full train state (the FLA weights,
a fresh optimizer state, the data iterator at its start) and ``config.json`` into ``workdir``; training with that
config in that workdir resumes from it, i.e. starts from FLA's initialisation. ``config`` supplies everything but
the model shape (default: ``hybrid_jax.config.base_config()``).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import base_config, to_json
from hybrid_jax.export.fla import from_fla, model_config_from_fla
from hybrid_jax.export.tensors import check_model_params, load_safetensors
from hybrid_jax.model import HybridLM


def load_fla(fla_dir: str | Path, config: ConfigDict | None = None) -> tuple[ConfigDict, dict]:
    """``(our config, our flat parameters)`` of the FLA checkpoint in ``fla_dir``; names and shapes checked."""
    fla_dir = Path(fla_dir)
    fla_cfg = json.loads((fla_dir / "config.json").read_text())
    config = model_config_from_fla(fla_cfg, config or base_config())
    params = from_fla(load_safetensors(fla_dir), config.model)
    check_model_params(params, nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0))))
    return config, params


def _dotted(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def import_fla(fla_dir: str | Path, workdir: str | Path, config: ConfigDict | None = None) -> ConfigDict:
    """Write the FLA checkpoint in ``fla_dir`` as a resumable step-0 checkpoint in ``workdir``; returns the config."""
    config, params = load_fla(fla_dir, config)
    write_workdir(config, params, workdir)
    return config


def write_workdir(config: ConfigDict, params: dict, workdir: str | Path) -> None:
    """A fresh run directory whose step-0 checkpoint holds ``params`` (flat dict) and a fresh optimizer state; the
    trainer resumes from it with ``config`` (``config.train.workdir`` is set to ``workdir``)."""
    from hybrid_jax.data import make_train_iterator
    from hybrid_jax.train import mesh as mesh_lib
    from hybrid_jax.train.checkpoint import Checkpointer
    from hybrid_jax.train.optim import make_optimizer
    from hybrid_jax.train.step import init_state

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
