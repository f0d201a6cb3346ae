"""Import an FLA-format checkpoint (``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM``: config.json + safetensors).

``import_fla(fla_dir, workdir, config=None)`` writes a step-0 checkpoint of the full train state (the FLA weights,
a fresh optimizer state, the data iterator at its start; written by ``hybrid_jax.train.warm_start``) and
``config.json`` into ``workdir``; training with that config in that workdir resumes from it, i.e. starts from FLA's
initialisation. ``config`` supplies everything but the model shape (default: ``hybrid_jax.config.base_config()``).
"""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import base_config
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


def import_fla(fla_dir: str | Path, workdir: str | Path, config: ConfigDict | None = None) -> ConfigDict:
    """Write the FLA checkpoint in ``fla_dir`` as a resumable step-0 checkpoint in ``workdir``; returns the config.

    A training start holds an optimizer state, so this function and ``import_hf`` are the export package's only
    calls into the trainer (:func:`hybrid_jax.train.warm_start.write_workdir`)."""
    from hybrid_jax.train.warm_start import write_workdir

    config, params = load_fla(fla_dir, config)
    write_workdir(config, params, workdir)
    return config
