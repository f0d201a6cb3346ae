"""The recurrent kernel calls the tuner sweeps (a config's, head dims padded as the tuning file keys them) and random
inputs for them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from hybrid_jax.kernels import reference
from hybrid_jax.model.kernel_calls import Case, cases_of


class TuneError(ValueError):
    """Bad input to the tuner, said in one line before anything is compiled."""


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def problems_of(cfg, batch: int, seq_len: int | None, max_heads: int | None, dtype: str) -> list[Case]:
    """The recurrent kernel calls of a run config (:func:`hybrid_jax.model.kernel_calls.cases_of`), keyed as the
    tuning file is: head dims padded to powers of two >= 16. ``batch`` caps the micro batch; ``seq_len`` (None: the
    config's) is rounded up to whole 64-row chunks; ``max_heads`` caps q/k heads and value heads per q/k head;
    ``dtype``: what the sweep runs in (one problem for configs that differ only in their compute dtype)."""
    T = -(-(seq_len or cfg.train.seq_len) // 64) * 64
    return [dataclasses.replace(c, T=T, K=_pow2(c.K), V=_pow2(c.V), dtype=dtype, scale=None)
            for c in cases_of(cfg, batch=batch, seq_len=None, max_heads=max_heads) if c.op != "attention"]


def fit_batch(p: Case, bytes_limit: int | None) -> Case:
    """``p`` with its batch halved until a rough upper bound of one fwd+bwd's memory (float32 inputs, gradients,
    reference and residuals, per-chunk states) is under half of ``bytes_limit`` (None: unknown, unchanged)."""
    def need(B: int) -> int:
        tokens = B * p.T * p.HV
        return 4 * tokens * (6 * (p.K + p.V) + 2 * p.K * (p.op == "kda")) + 8 * tokens // 16 * p.K * p.V
    B = p.B
    while bytes_limit and B > 1 and need(B) > bytes_limit // 2:
        B //= 2
    return dataclasses.replace(p, B=B)


def inputs(p: Case, dtype, seed: int = 0) -> dict[str, jax.Array]:
    """Random inputs as a model gives them (unit-norm keys, gates in (-1/16 ln 2, 0), beta in (0, 1))."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = dict(q=jax.random.normal(ks[0], (p.B, p.T, p.H, p.K), dtype),
             k=reference.l2_normalize(jax.random.normal(ks[1], (p.B, p.T, p.H, p.K))).astype(dtype),
             v=jax.random.normal(ks[2], (p.B, p.T, p.HV, p.V), dtype),
             g=jax.nn.log_sigmoid(jax.random.normal(ks[3], (p.B, p.T, p.HV) + ((p.K,) if p.per_key else ()))) / 16)
    if p.delta:
        x["beta"] = jax.nn.sigmoid(jax.random.normal(ks[4], (p.B, p.T, p.HV))).astype(dtype)
    return x



def published_configs() -> list[Path]:
    for root in (Path.cwd() / "configs", Path(__file__).resolve().parents[1] / "configs"):
        found = sorted(root.glob("zebra_*.py"))
        if found:
            return found
    raise TuneError("no configs/zebra_*.py here: pass --config configs/X.py")
