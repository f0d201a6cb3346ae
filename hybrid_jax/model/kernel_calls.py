"""The kernel calls a run config's model makes, as problems of the kernel tooling
(:class:`hybrid_jax.kernels.tooling.problems.Problem`): one per mixer kind and one for MLA's attention, at the config's
shapes (what ``python -m hybrid_jax.doctor`` checks and ``python -m hybrid_jax.tune`` sweeps). The kernels know
nothing of configs: this is the one place that maps a model to them."""

from __future__ import annotations

from pathlib import Path

from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.model.plan import sublayer_kinds

# sublayer kind -> the kernel op it calls (an op of hybrid_jax.kernels.registry.OPS)
KINDS = {"gdn": "gdn", "kda": "kda", "mamba2": "gla", "mla": "attention"}


def problems_of(cfg, *, batch: int, seq_len: int | None, max_heads: int | None) -> list[Problem]:
    """The kernel calls of a run config (``model`` and ``train``), one per kernel its plan uses, in the model's
    compute dtype at its chunk size (attention: 0) and scale (None: ``K**-0.5``; Mamba2: 1), at batch
    ``min(batch, micro batch)`` and ``min(seq_len, train.seq_len)`` tokens (None: the config's); ``max_heads`` caps
    q/k heads and value heads per q/k head (interpret mode)."""
    m = cfg.model
    T = min(seq_len or cfg.train.seq_len, cfg.train.seq_len)
    B = min(batch, cfg.train.micro_batch_size)
    out = []
    for kind in dict.fromkeys(sublayer_kinds(m)):
        if kind not in KINDS:
            continue
        scale = None
        if kind == "mamba2":
            c = m.mamba2
            H, HV, K, V, scale = c.num_groups, c.expand * m.hidden_size // c.head_dim, c.state_dim, c.head_dim, 1.0
        elif kind == "mla":
            c = m.mla
            H = HV = c.num_heads
            K, V = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        else:
            c = m[kind]
            H, HV, K, V = c.num_key_heads, c.num_value_heads, c.key_head_dim, c.value_head_dim
        if max_heads:
            H, HV = min(H, max_heads), (min(H, max_heads) * min(HV // H, max_heads) if kind != "mla"
                                        else min(H, max_heads))
        out.append(Problem(KINDS[kind], B, T, H, HV, K, V, m.dtype, 0 if kind == "mla" else m.chunk_size, scale))
    return out


def published_configs() -> list[Path]:
    """The published run configs (``configs/zebra_*.py``) that the doctor and the tuner take by default: under the
    current directory's ``configs/``, else the source checkout's; empty when there are none."""
    for root in (Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs"):
        if found := sorted(root.glob("zebra_*.py")):
            return found
    return []
