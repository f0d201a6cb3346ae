"""The recurrent kernel problems the tuner sweeps: a config's (``hybrid_jax.model.kernel_calls``), keyed as the
tuning file keys them, at a batch that fits the device."""

from __future__ import annotations

import dataclasses

from hybrid_jax.kernels.tooling.problems import Problem, pow2
from hybrid_jax.model.kernel_calls import problems_of


class TuneError(ValueError):
    """Bad input to the tuner, said in one line before anything is compiled."""


def tuning_problems(cfg, batch: int, seq_len: int | None, max_heads: int | None, dtype: str) -> list[Problem]:
    """The recurrent kernel problems of a run config with head dims padded to powers of two >= 16 (the tuning file's
    key). ``batch`` caps the micro batch; ``seq_len`` (None: the config's) is rounded up to whole 64-row chunks;
    ``max_heads`` caps q/k heads and value heads per q/k head; ``dtype``: what the sweep runs in (one problem for
    configs that differ only in their compute dtype)."""
    T = -(-(seq_len or cfg.train.seq_len) // 64) * 64
    return [dataclasses.replace(p, T=T, K=pow2(p.K), V=pow2(p.V), dtype=dtype, scale=None, name="")
            for p in problems_of(cfg, batch=batch, seq_len=None, max_heads=max_heads) if p.recurrent]


def fit_batch(p: Problem, bytes_limit: int | None) -> Problem:
    """``p`` with its batch halved until a rough upper bound of one fwd+bwd's memory (float32 inputs, gradients,
    reference and residuals, per-chunk states) is under half of ``bytes_limit`` (None: unknown, unchanged)."""
    def need(B: int) -> int:
        tokens = B * p.T * p.HV
        return 4 * tokens * (6 * (p.K + p.V) + 2 * p.K * p.per_key) + 8 * tokens // 16 * p.K * p.V
    B = p.B
    while bytes_limit and B > 1 and need(B) > bytes_limit // 2:
        B //= 2
    return dataclasses.replace(p, B=B)
