"""The kernel calls a run config's model makes: one per mixer kind and one for MLA's attention, at the config's
shapes (what ``python -m hybrid_jax.doctor`` checks and ``python -m hybrid_jax.tune`` sweeps)."""

from __future__ import annotations

import dataclasses

from hybrid_jax.model.plan import sublayer_kinds

# sublayer kind -> the kernel op it calls
KINDS = {"gdn": "gdn", "kda": "kda", "mamba2": "gla", "mla": "attention"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call: q/k ``[B,T,H,K]``, v ``[B,T,HV,V]`` (attention: ``HV == H``, K the qk head dim, V the v
    head dim); ``chunk`` the model's chunk size (0: the tuned one); ``scale`` the model's (None: ``K**-0.5``)."""

    op: str  # gdn | kda | gla | attention
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str = "bfloat16"
    chunk: int = 0
    scale: float | None = None

    @property
    def delta(self) -> bool:
        """A delta rule (GDN, KDA) rather than plain gated linear attention."""
        return self.op in ("gdn", "kda")

    @property
    def per_key(self) -> bool:
        return self.op == "kda"

    @property
    def key(self) -> tuple[str, int, int]:
        """``(op, K, V)``: a tuning file's key (with padded head dims)."""
        return self.op, self.K, self.V

    @property
    def name(self) -> str:
        return f"{self.op} H{self.H}/{self.HV} K{self.K} V{self.V}"

    @property
    def shape(self) -> str:
        return f"B{self.B} T{self.T} H{self.H}/{self.HV} K{self.K} V{self.V} {self.dtype}"

    def small(self, T: int = 37, heads: int = 2) -> Case:
        """The same head dims at one ragged sequence of ``T`` tokens and at most ``heads`` q/k heads (grouping
        kept: at most ``heads`` value heads per q/k head)."""
        H = min(self.H, heads)
        HV = H if self.op == "attention" else H * min(self.HV // self.H, heads)
        return dataclasses.replace(self, B=1, T=T, H=H, HV=HV)


def cases_of(cfg, *, batch: int, seq_len: int | None, max_heads: int | None) -> list[Case]:
    """The kernel calls of a run config (``model`` and ``train``), one per kernel its plan uses, at batch
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
        out.append(Case(KINDS[kind], B, T, H, HV, K, V, m.dtype, 0 if kind == "mla" else m.chunk_size, scale))
    return out
