"""Loading an exported HF directory as a PyTorch model without running code nobody asked to run.

Our own exports (``model_type`` ``hybrid_jax``) load with the modeling code of this package
(``hybrid_jax/export/modeling_hybrid.py``), never with the copy in the directory: a copy that differs from ours is
said in a note and not run. Any other directory whose ``config.json`` asks for its own code (``auto_map``) is refused
unless the caller passes ``trust_remote_code=True`` (the commands' ``--trust-remote-code``); the user's choice then
runs the directory's code, ours included.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hybrid_jax.export.hf import MODELING_FILE


class RemoteCodeRefused(ValueError):
    """A directory whose model would run its own Python code, without ``trust_remote_code``."""


def load_export(directory: str | Path, *, trust_remote_code: bool = False, dtype=None,
                note: Callable[[str], None] = print):
    """The model of the exported directory (``transformers`` ``PreTrainedModel``, eval mode) in ``dtype`` (default
    float32); see the module docstring for whose code runs."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    dtype = torch.float32 if dtype is None else dtype
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not an export (python -m hybrid_jax.export --out "
                                "DIR)")
    config = json.loads(path.read_text())
    if config.get("model_type") == "hybrid_jax" and not trust_remote_code:
        from hybrid_jax.export.modeling_hybrid import HybridJaxForCausalLM

        copy = directory / MODELING_FILE.name
        if copy.is_file() and copy.read_bytes() != MODELING_FILE.read_bytes():
            note(f"note: {copy} differs from this version's modeling code; loading with this version's "
                 "(--trust-remote-code runs the directory's instead)")
        return HybridJaxForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    if config.get("auto_map") and not trust_remote_code:
        wanted = ", ".join(config["auto_map"].values())
        raise RemoteCodeRefused(f"{directory} asks to run its own Python code ({wanted}); it is not one of our "
                                "exports: pass --trust-remote-code to run it anyway")
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=trust_remote_code, dtype=dtype).eval()
