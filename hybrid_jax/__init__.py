"""hybrid_jax: pre-train hybrid recurrent-attention language models (Mamba2 / Gated DeltaNet / KDA + MLA) in JAX.

``hybrid_jax.load(workdir, step=None) -> (model, config)`` loads a trained model (imported on first use).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load"]


def __getattr__(name: str) -> Any:
    if name == "load":
        from hybrid_jax.checkpoints import load

        return load
    raise AttributeError(f"module 'hybrid_jax' has no attribute {name!r}")
