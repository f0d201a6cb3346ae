"""hybrid_jax.eval: lm-eval on our checkpoints (JAX model directly) or on HF exports, with local task files.

``evaluate(tasks=[...], workdir=DIR | hf_dir=DIR, limit=None, batch_size=8, data_dir=None)``; CLI
``python -m hybrid_jax.eval``. Needs the ``eval`` extra (lm-eval; the HF path also the ``export`` extra).
"""

from hybrid_jax.eval.run import evaluate

__all__ = ["evaluate"]
