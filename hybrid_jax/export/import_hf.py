"""Import one of our own HF exports (``python -m hybrid_jax.export --format hf``: config.json + safetensors).

``import_hf(hf_dir, workdir, config=None)`` writes a step-0 checkpoint of the export's weights (a fresh optimizer
state, the data iterator at its start; written by ``hybrid_jax.train.warm_start``) and ``config.json`` into
``workdir``, as :func:`hybrid_jax.export.import_fla.import_fla` does for FLA checkpoints: training that config in
that workdir resumes from it. ``config`` supplies every key the export does not record (default:
``hybrid_jax.config.base_config()``). The names are :func:`hybrid_jax.export.hf.hf_name`'s table read backwards.
"""

from __future__ import annotations

from pathlib import Path

from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import base_config
from hybrid_jax.export.hf import from_hf, model_config_from_hf, read_export_config
from hybrid_jax.export.tensors import check_model_params, load_safetensors
from hybrid_jax.model import HybridLM, param_shapes


def load_hf(hf_dir: str | Path, config: ConfigDict | None = None) -> tuple[ConfigDict, dict]:
    """``(our config, our flat parameters)`` of the HF export in ``hf_dir``; a directory that is not one of our
    exports is refused (:class:`~hybrid_jax.export.tensors.ExportError`) before its weights are read."""
    hf_dir = Path(hf_dir)
    config = model_config_from_hf(read_export_config(hf_dir), config or base_config())
    abstract = nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0)))
    params = from_hf(load_safetensors(hf_dir), list(param_shapes(abstract)))
    check_model_params(params, abstract)
    return config, params


def import_hf(hf_dir: str | Path, workdir: str | Path, config: ConfigDict | None = None) -> ConfigDict:
    """Write the HF export in ``hf_dir`` as a resumable step-0 checkpoint in ``workdir``; returns the config."""
    from hybrid_jax.train.warm_start import write_workdir

    config, params = load_hf(hf_dir, config)
    write_workdir(config, params, workdir)
    return config
