"""Checkpoints from PyTorch formats into a workdir: FLA's (``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM``) and our
own HF exports (``python -m hybrid_jax.export --format hf``), each config.json + safetensors.

``load_fla`` / ``load_hf`` give ``(our config, our flat parameters)``, names and shapes checked; ``import_fla`` /
``import_hf`` write them as a resumable step-0 checkpoint of the full train state (the weights, a fresh optimizer
state, the data iterator at its start; :func:`hybrid_jax.train.warm_start.write_workdir`) and ``config.json`` into
``workdir``: training with that config in that workdir starts from those weights. ``config`` supplies every key the
checkpoint does not record (default: ``hybrid_jax.config.base_config()``). The HF names are
:func:`hybrid_jax.export.hf.hf_name`'s table read backwards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import base_config
from hybrid_jax.export.fla import from_fla, model_config_from_fla
from hybrid_jax.export.hf import from_hf, model_config_from_hf, read_export_config
from hybrid_jax.export.tensors import check_model_params, load_safetensors
from hybrid_jax.model import HybridLM, param_shapes

Loader = Callable[[str | Path, ConfigDict | None], tuple[ConfigDict, dict]]


def load_fla(fla_dir: str | Path, config: ConfigDict | None = None) -> tuple[ConfigDict, dict]:
    """``(our config, our flat parameters)`` of the FLA checkpoint in ``fla_dir``; names and shapes checked."""
    fla_dir = Path(fla_dir)
    fla_cfg = json.loads((fla_dir / "config.json").read_text())
    config = model_config_from_fla(fla_cfg, config or base_config())
    params = from_fla(load_safetensors(fla_dir), config.model)
    check_model_params(params, nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0))))
    return config, params


def load_hf(hf_dir: str | Path, config: ConfigDict | None = None) -> tuple[ConfigDict, dict]:
    """``(our config, our flat parameters)`` of the HF export in ``hf_dir``; a directory that is not one of our
    exports is refused (:class:`~hybrid_jax.export.tensors.ExportError`) before its weights are read."""
    hf_dir = Path(hf_dir)
    config = model_config_from_hf(read_export_config(hf_dir), config or base_config())
    abstract = nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0)))
    params = from_hf(load_safetensors(hf_dir), list(param_shapes(abstract)))
    check_model_params(params, abstract)
    return config, params


def write_training_start(load: Loader, source: str | Path, workdir: str | Path, config: ConfigDict | None = None
                         ) -> ConfigDict:
    """``load(source, config)`` written as a resumable step-0 checkpoint in ``workdir``; returns the config.

    A training start holds an optimizer state, so this is the export package's one call into the trainer."""
    from hybrid_jax.train.warm_start import write_workdir

    config, params = load(source, config)
    write_workdir(config, params, workdir)
    return config


def import_fla(fla_dir: str | Path, workdir: str | Path, config: ConfigDict | None = None) -> ConfigDict:
    """The FLA checkpoint in ``fla_dir`` as a training start in ``workdir`` (:func:`write_training_start`)."""
    return write_training_start(load_fla, fla_dir, workdir, config)


def import_hf(hf_dir: str | Path, workdir: str | Path, config: ConfigDict | None = None) -> ConfigDict:
    """Our HF export in ``hf_dir`` as a training start in ``workdir`` (:func:`write_training_start`)."""
    return write_training_start(load_hf, hf_dir, workdir, config)
