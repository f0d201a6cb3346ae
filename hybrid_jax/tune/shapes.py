"""The recurrent kernel calls a run config makes (one per mixer kind, padded head dims) and random inputs for them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from hybrid_jax.kernels import reference
from hybrid_jax.model.plan import sublayer_kinds

MIXER_OPS = {"gdn": "gdn", "kda": "kda", "mamba2": "gla"}


class TuneError(ValueError):
    """Bad input to the tuner, said in one line before anything is compiled."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One recurrent kernel call of a config: q/k ``[B,T,H,K]``, v ``[B,T,HV,V]``, head dims padded (powers of two >=
    16, the tuning file's keys); ``chunk``: the model's chunk size (0: the table's)."""

    op: str  # gdn | kda | gla
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    chunk: int = 0

    @property
    def delta(self) -> bool:
        return self.op != "gla"

    @property
    def per_key(self) -> bool:
        return self.op == "kda"

    @property
    def key(self) -> tuple[str, int, int]:
        return self.op, self.K, self.V


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def problems_of(cfg, batch: int, seq_len: int | None, max_heads: int | None) -> list[Problem]:
    """The recurrent kernel calls of a run config (``model`` and ``train``): one per mixer kind its plan uses.
    ``batch`` caps the micro batch; ``seq_len`` (None: the config's) is rounded up to whole 64-row chunks;
    ``max_heads`` caps q/k heads and value heads per q/k head (interpret mode)."""
    m = cfg.model
    out = []
    for kind in dict.fromkeys(sublayer_kinds(m)):
        if kind not in MIXER_OPS:
            continue
        if kind == "mamba2":
            c = m.mamba2
            H, HV, K, V = c.num_groups, c.expand * m.hidden_size // c.head_dim, c.state_dim, c.head_dim
        else:
            c = m[kind]
            H, HV, K, V = c.num_key_heads, c.num_value_heads, c.key_head_dim, c.value_head_dim
        if max_heads:
            H, HV = min(H, max_heads), min(H, max_heads) * min(HV // H, max_heads)
        T = -(-(seq_len or cfg.train.seq_len) // 64) * 64
        out.append(Problem(MIXER_OPS[kind], min(batch, cfg.train.micro_batch_size), T, H, HV, _pow2(K), _pow2(V),
                           m.chunk_size))
    return out


def fit_batch(p: Problem, bytes_limit: int | None) -> Problem:
    """``p`` with its batch halved until a rough upper bound of one fwd+bwd's memory (float32 inputs, gradients,
    reference and residuals, per-chunk states) is under half of ``bytes_limit`` (None: unknown, unchanged)."""
    def need(B: int) -> int:
        tokens = B * p.T * p.HV
        return 4 * tokens * (6 * (p.K + p.V) + 2 * p.K * (p.op == "kda")) + 8 * tokens // 16 * p.K * p.V
    B = p.B
    while bytes_limit and B > 1 and need(B) > bytes_limit // 2:
        B //= 2
    return dataclasses.replace(p, B=B)


def inputs(p: Problem, dtype, seed: int = 0) -> dict[str, jax.Array]:
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
