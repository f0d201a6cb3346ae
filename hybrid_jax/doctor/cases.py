"""The kernel calls a run config makes (one per mixer kind and one for MLA's attention) and model-like inputs."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax import kernels
from hybrid_jax.model.plan import sublayer_kinds

# op -> the public function of hybrid_jax.kernels (looked up at call time, so a test can patch it)
FUNCTIONS = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "gla": "chunk_simple_gla",
             "attention": "attention"}
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
    dtype: str
    chunk: int = 0
    scale: float | None = None

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


def inputs(case: Case, seed: int = 0) -> dict[str, jax.Array]:
    """Random inputs as the model gives them, in the case's dtype (gates and states float32): gates
    ``-A softplus(a + dt_bias)`` with ``A ~ U(1, 16)`` and ``dt`` around 1e-3..1e-1 (Mamba2: ``v = dt x``,
    ``g = dt A``), beta a sigmoid; an initial state for the recurrences. Drawn on the host (NumPy): no compiles."""
    rng = np.random.default_rng(seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    dtype = jnp.dtype(case.dtype)
    if case.op == "attention":
        return dict(q=jnp.asarray(normal(B, T, H, K), dtype), k=jnp.asarray(normal(B, T, H, K), dtype),
                    v=jnp.asarray(normal(B, T, H, V), dtype))
    gate_shape = (B, T, HV, K) if case.op == "kda" else (B, T, HV)
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), gate_shape[2:]))
    dt = np.logaddexp(0.0, normal(*gate_shape) + np.log(np.expm1(dt)))  # softplus(a + dt_bias)
    g = -rng.uniform(1.0, 16.0, gate_shape[2:]) * dt
    v = normal(B, T, HV, V) * (dt[..., None] if case.op == "gla" else 1.0)
    x = dict(q=jnp.asarray(normal(B, T, H, K), dtype), k=jnp.asarray(normal(B, T, H, K), dtype),
             v=jnp.asarray(v, dtype), g=jnp.asarray(g, jnp.float32))
    if case.op != "gla":
        x["beta"] = jnp.asarray(1 / (1 + np.exp(-normal(B, T, HV))), dtype)
    x["initial_state"] = jnp.asarray(0.1 * normal(B, HV, K, V), jnp.float32)
    return x


def call(case: Case, x: dict[str, jax.Array], impl: str) -> tuple[jax.Array, jax.Array | None]:
    """``(o, final state or None)`` of the case's public kernel function on ``x`` with ``impl`` (the case's chunk
    for the Pallas kernels, the XLA form's own otherwise)."""
    fn = getattr(kernels, FUNCTIONS[case.op])
    if case.op == "attention":
        return fn(x["q"], x["k"], x["v"], causal=True, scale=case.scale, impl=impl), None
    kw = dict(scale=case.scale, initial_state=x["initial_state"], output_final_state=True,
              chunk_size=(case.chunk or None) if impl.startswith("pallas") else None, impl=impl)
    if case.op == "gla":
        return fn(x["q"], x["k"], x["v"], x["g"], **kw)
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm=True, **kw)
