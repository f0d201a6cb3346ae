"""hybrid_jax.export: checkpoints to PyTorch (HF with a self-contained modeling file; FLA for pure GDN/KDA) and back.

``export(workdir, out, step=None, fmt="hf"|"fla", dtype="fp32"|"bf16")`` writes an export directory;
``import_fla(fla_dir, workdir, config=None)`` and ``import_hf(hf_dir, workdir, config=None)`` turn an FLA checkpoint
or one of our HF exports into a resumable step-0 workdir. The CLI is ``python -m hybrid_jax.export``. Needs the
``export`` extra (torch, transformers, safetensors).
"""

from hybrid_jax.export.imports import import_fla, import_hf, load_fla, load_hf
from hybrid_jax.export.tensors import ExportError
from hybrid_jax.export.writer import export, export_model

__all__ = ["ExportError", "export", "export_model", "import_fla", "import_hf", "load_fla", "load_hf"]
