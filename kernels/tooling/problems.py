"""The one problem type: the shapes of one kernel call, given by hand (``benchmarks/shapes.py``, the tests) or built
from a run config (``hybrid_jax.model.kernel_calls.problems_of``: the kernels know nothing of configs).

Importing this module initialises no JAX backend (``jax.ShapeDtypeStruct`` needs none): the reference benchmark
(``benchmarks/fla_reference.py``) imports the benchmark problems in a PyTorch process that must keep the GPU's
memory to itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybrid_jax.kernels.registry import OPS


def pow2(n: int) -> int:
    """``n`` padded as the kernels pad head dims: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Problem:
    """One kernel call: q, k ``[B,T,H,K]``; v ``[B,T,HV,V]`` (``HV`` a multiple of ``H``: grouped value heads); the
    gate ``g [B,T,HV]`` (``[B,T,HV,K]`` for ``kda``); ``beta [B,T,HV]`` with the delta rule (``gdn``, ``kda``); an
    initial state ``[B,HV,K,V]`` float32. ``attention``: ``HV == H``, ``K`` the qk head dim, ``V`` the v head dim.

    ``op``: a name of ``kernels.registry.OPS``; ``dtype``: of q, k, v and beta (gates and states are float32);
    ``chunk``: the Pallas kernels' chunk (0: the tuned one); ``scale``: None is ``K**-0.5``; ``name``: a label
    (default ``"OP H{H}/{HV} K{K} V{V}"``)."""

    op: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str = "bfloat16"
    chunk: int = 0
    scale: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Problem: op must be one of {tuple(OPS)}, got {self.op!r}")
        if self.HV % self.H or (self.op == "attention" and self.HV != self.H):
            raise ValueError(f"Problem {self.op}: HV={self.HV} must be a multiple of H={self.H} (equal for attention)")
        if not self.name:
            object.__setattr__(self, "name", self._label())

    def _label(self) -> str:
        return f"{self.op} H{self.H}/{self.HV} K{self.K} V{self.V}"

    @property
    def delta(self) -> bool:
        """The delta rule (GDN, KDA: takes ``beta``) rather than plain gated linear attention."""
        return OPS[self.op].delta

    @property
    def per_key(self) -> bool:
        """A decay per key channel (KDA): ``g [B,T,HV,K]``."""
        return OPS[self.op].per_key

    @property
    def recurrent(self) -> bool:
        """A chunked recurrence rather than attention."""
        return OPS[self.op].recurrent

    @property
    def key(self) -> tuple[str, int, int]:
        """``(op, K, V)`` with the head dims padded: a tuning file's key."""
        return self.op, pow2(self.K), pow2(self.V)

    @property
    def shape(self) -> str:
        return f"B{self.B} T{self.T} H{self.H}/{self.HV} K{self.K} V{self.V} {self.dtype}"

    def small(self, T: int = 37, heads: int = 2) -> Problem:
        """The same head dims at one ragged sequence of ``T`` tokens and at most ``heads`` q/k heads (grouping
        kept: at most ``heads`` value heads per q/k head); a default name follows the heads."""
        H = min(self.H, heads)
        HV = H if self.op == "attention" else H * min(self.HV // self.H, heads)
        return dataclasses.replace(self, B=1, T=T, H=H, HV=HV, name="" if self.name == self._label() else self.name)

    def specs(self, *, initial_state: bool = False, segments: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
        """The arguments as ``ShapeDtypeStruct`` (what lowering needs, no arrays): ``q, k, v``; for a recurrence
        ``g`` (float32) and, with the delta rule, ``beta``; ``initial_state [B,HV,K,V]`` float32 if asked;
        ``segment_ids [B,T]`` int32 if ``segments``."""
        B, T, H, HV, K, V, dt = self.B, self.T, self.H, self.HV, self.K, self.V, jnp.dtype(self.dtype)
        out = dict(q=jax.ShapeDtypeStruct((B, T, H, K), dt), k=jax.ShapeDtypeStruct((B, T, H, K), dt),
                   v=jax.ShapeDtypeStruct((B, T, HV, V), dt))
        if self.recurrent:
            out["g"] = jax.ShapeDtypeStruct((B, T, HV, K) if self.per_key else (B, T, HV), jnp.float32)
            if self.delta:
                out["beta"] = jax.ShapeDtypeStruct((B, T, HV), dt)
            if initial_state:
                out["initial_state"] = jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)
        if segments:
            out["segment_ids"] = jax.ShapeDtypeStruct((B, T), jnp.int32)
        return out
