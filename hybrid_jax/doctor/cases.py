"""Model-like inputs for a run config's kernel calls (:mod:`hybrid_jax.model.kernel_calls`) and the call itself."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax import kernels
from hybrid_jax.model.kernel_calls import Case

# op -> the public function of hybrid_jax.kernels (looked up at call time, so a test can patch it)
FUNCTIONS = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "gla": "chunk_simple_gla",
             "attention": "attention"}


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
