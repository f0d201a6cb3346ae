"""The one input generator: random arguments of a :class:`Problem`, drawn on the host (NumPy: no compiles).

Two laws for the recurrences' gates:

- ``model`` (the default; the doctor, the tests, the tuner's numerics check, the accuracy benchmark): as the
  models give them, ``g = -A softplus(a + dt_bias)`` with ``A ~ U(1, 16)`` and ``dt = softplus(dt_bias)`` log-uniform
  in ``[1e-3, 1e-1]`` per head (per head and key channel for KDA), ``a ~ N(0, 1)`` per token; Mamba2's SSD (``gla``)
  also scales ``v`` by ``dt`` (``v = dt x``); ``beta = sigmoid(N(0, 1))``; q and k ``N(0, 1)`` (the kernels
  L2-normalise them with the delta rule). Some heads then decay by several e-folds per token, so KDA's diagonal
  blocks take their fallback path in some chunks, as in a model.
- ``fla`` (timings: benchmarks, autotune, the tuner's timings): FLA's benchmark law, which the reference side
  (``benchmarks/fla_reference.py``) draws its own inputs with, ``g = logsigmoid(N(0, 1)) / 16``, k L2-normalised,
  ``beta = sigmoid(U(0, 1))``: our times stay comparable with FLA's and with the earlier records (the KDA kernels'
  time depends on how fast the gate falls within a chunk).

Attention takes ``q, k, v ~ N(0, 1)`` under either law. Gates and states are float32; q, k, v and beta the problem's
dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.kernels.tooling.problems import Problem

LAWS = ("model", "fla")


def inputs(p: Problem, seed: int = 0, *, law: str = "model", initial_state: bool = True,
           dt_range: tuple[float, float] = (1e-3, 1e-1)) -> dict[str, jax.Array]:
    """``{q [B,T,H,K], k, v [B,T,HV,V]}``; for a recurrence also ``g [B,T,HV]`` (``[B,T,HV,K]`` for KDA), ``beta
    [B,T,HV]`` with the delta rule and, if ``initial_state``, ``initial_state [B,HV,K,V]`` (``N(0, 1)``: about the size
    of a state that has taken in as many keys as it has channels).
    ``dt_range``: the model law's ``(dt_min, dt_max)``, as a model's config initialises them (a smaller ``dt_max``:
    no head forgets within a few tokens)."""
    if law not in LAWS:
        raise ValueError(f"inputs: law must be one of {LAWS}, got {law!r}")
    rng = np.random.default_rng(seed)
    B, T, H, HV, K, V = p.B, p.T, p.H, p.HV, p.K, p.V
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    dtype = jnp.dtype(p.dtype)
    if not p.recurrent:
        return dict(q=jnp.asarray(normal(B, T, H, K), dtype), k=jnp.asarray(normal(B, T, H, K), dtype),
                    v=jnp.asarray(normal(B, T, H, V), dtype))
    gate_shape = (B, T, HV, K) if p.per_key else (B, T, HV)
    if law == "model":
        dt = np.exp(rng.uniform(math.log(dt_range[0]), math.log(dt_range[1]), gate_shape[2:]))
        dt = np.logaddexp(0.0, normal(*gate_shape) + np.log(np.expm1(dt)))  # softplus(a + dt_bias)
        g = -rng.uniform(1.0, 16.0, gate_shape[2:]) * dt
        v = normal(B, T, HV, V) * (dt[..., None] if p.op == "gla" else 1.0)
        x = dict(q=normal(B, T, H, K), k=normal(B, T, H, K), v=v, g=g)
        if p.delta:
            x["beta"] = 1 / (1 + np.exp(-normal(B, T, HV)))
    else:
        k = normal(B, T, H, K)
        x = dict(q=normal(B, T, H, K), k=k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6), v=normal(B, T, HV, V),
                 g=-np.logaddexp(0.0, -normal(*gate_shape)) / 16)  # logsigmoid(N(0, 1)) / 16
        if p.delta:
            x["beta"] = 1 / (1 + np.exp(-rng.uniform(0.0, 1.0, (B, T, HV))))
    out = {n: jnp.asarray(a, jnp.float32 if n == "g" else dtype) for n, a in x.items()}
    if initial_state:
        out["initial_state"] = jnp.asarray(normal(B, HV, K, V), jnp.float32)
    return out


def cotangents(p: Problem, seed: int = 1) -> tuple[jax.Array, jax.Array | None]:
    """Random cotangents ``(do [B,T,HV,V] in the problem's dtype, d final_state [B,HV,K,V] float32)`` for a
    forward + backward (attention: ``(do, None)``)."""
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.standard_normal((p.B, p.T, p.HV, p.V), np.float32), p.dtype)
    if not p.recurrent:
        return do, None
    return do, jnp.asarray(rng.standard_normal((p.B, p.HV, p.K, p.V), np.float32))
