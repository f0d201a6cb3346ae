"""Shared pieces of export and import: flat parameter dicts, layouts, name/shape checks, safetensors I/O.

A *flat* parameter dict maps our dotted NNX paths (``layers.3.mixer.A_log``, see ``hybrid_jax.model.params``) to
float32 numpy arrays in our layouts (Linear ``kernel [in, out]``, conv ``kernel [K, C]``). A layout names how one
of our arrays becomes PyTorch's:

* ``linear``: our ``kernel [in, out]`` is PyTorch ``weight [out, in]`` (transpose);
* ``conv``: our ``kernel [K, C]`` is PyTorch depthwise ``weight [C, 1, K]``;
* ``same``: vectors (norm weights, ``A_log``, ``dt_bias``, biases), the embedding and ``lm_head``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from flax import nnx

from hybrid_jax.model.params import param_shapes, path_name

DTYPES = {"fp32": np.float32, "bf16": "bfloat16"}


class ExportError(ValueError):
    """A tensor is missing, unexpected or of the wrong shape; the message names the offending key."""


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every ``nnx.Param`` of ``model`` as ``{dotted path: float32 numpy array}``."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {path_name(path): np.asarray(var[...], np.float32) for path, var in flat}


def to_torch(x: np.ndarray, layout: str) -> np.ndarray:
    """Our array in PyTorch's layout (``linear | conv | same``, see the module docstring)."""
    return {"linear": lambda a: a.T, "conv": lambda a: a.T[:, None, :], "same": lambda a: a}[layout](x)


def from_torch(x: np.ndarray, layout: str) -> np.ndarray:
    """The inverse of :func:`to_torch`."""
    return {"linear": lambda a: a.T, "conv": lambda a: a[:, 0, :].T, "same": lambda a: a}[layout](x)


def check_tensors(tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Raise :class:`ExportError` naming the first key of ``tensors`` that ``expected`` lacks, the first expected key
    that is missing, or the first whose shape differs. ``what`` names the target format in the message."""
    for key, value in tensors.items():
        if key not in expected:
            raise ExportError(f"{what}: unexpected tensor {key!r} (shape {tuple(value.shape)})")
    for key, shape in expected.items():
        if key not in tensors:
            raise ExportError(f"{what}: missing tensor {key!r} (expected shape {tuple(shape)})")
        if tuple(tensors[key].shape) != tuple(shape):
            raise ExportError(f"{what}: tensor {key!r} has shape {tuple(tensors[key].shape)}, expected {tuple(shape)}")


def check_model_params(params: dict[str, np.ndarray], model: nnx.Module) -> None:
    """Names and shapes of a flat parameter dict against a (possibly abstract) model."""
    check_tensors(params, param_shapes(model), "our model")


def save_safetensors(tensors: dict[str, np.ndarray], path: Path, dtype: str = "fp32") -> None:
    """Write ``tensors`` (float32 numpy) as ``path`` in ``fp32`` or ``bf16`` through torch's safetensors writer."""
    import torch
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    save_file({k: torch.from_numpy(np.array(v, np.float32)).to(torch_dtype) for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    umask = os.umask(0o022)  # safetensors writes its file 0600: give it the mode every other file of the export gets
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def load_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of the ``*.safetensors`` files in ``directory`` as float32 numpy arrays."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items()})
    return out
