"""hybrid_jax.kernels: chunked recurrent kernels and attention, pure functions on arrays.

Public entry points (shapes ``[batch, time, heads, dim]``; states float32 ``[B,HV,K,V]``)::

    chunk_gated_delta_rule(q, k, v, g, beta, ...)   Gated DeltaNet (scalar decay per head)
    chunk_kda(q, k, v, g, beta, ...)                Kimi Delta Attention (decay per key channel)
    chunk_simple_gla(q, k, v, g, ...)               scalar-gated linear attention (Mamba2 SSD)
    attention(q, k, v, causal=True, ...)            softmax attention, qk dim may differ from v dim

``impl`` picks the implementation: ``"auto"`` (Pallas on GPU, XLA elsewhere), ``"xla"`` (chunked pure
JAX), ``"pallas"``, ``"pallas_interpret"`` (the Pallas code interpreted on CPU, for tests), ``"naive"``
(token-by-token recurrence; the ground truth).
"""

from hybrid_jax.kernels.api import attention, chunk_gated_delta_rule, chunk_kda, chunk_simple_gla

__all__ = ["attention", "chunk_gated_delta_rule", "chunk_kda", "chunk_simple_gla"]
