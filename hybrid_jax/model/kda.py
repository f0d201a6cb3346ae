"""Kimi Delta Attention mixer (Primus ``KimiDeltaAttention``, fused in_proj / FLA ``KimiDeltaAttention``).

With ``Hk`` key heads of dim ``dk`` and ``Hv`` value heads (a multiple of ``Hk``) of dim ``dv``::

    [q | k | v | f_a | g_a | b] = in_proj(x)           q, k: Hk*dk;  v: Hv*dv;  f_a, g_a: dv (low rank);  b: Hv
    [q | k | v] = silu(conv1d([q | k | v]))            depthwise causal, kernel conv_size, no bias
    f = f_b_proj(f_a)  (dv -> Hv*dk, no bias);   g = -exp(A_log[h]) * softplus(f + dt_bias)   per key channel, float32
    beta = sigmoid(b)
    o, S = chunk_kda(q, k, v, g, beta, use_qk_l2norm=True)
    y = out_proj(out_norm(o) * sigmoid(g_b_proj(g_a)))  g_b_proj: dv -> Hv*dv with bias; out_norm over dv, shared

``[q | k | v]`` and ``[f_a | g_a | b]`` are two matmuls on in_proj's columns: the conv gets its input without a
copy sliced from the whole projection, and the backward joins no gradients.

``f_b_proj`` and ``g_b_proj`` use PyTorch's default nn.Linear init (as the reference); the rest ``normal(init_std)``.
Sown intermediates: ``g [B,T,Hv,dk]``, ``beta [B,T,Hv]`` (float32), ``final_state [B,Hv,dk,dv]`` (float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax import kernels
from hybrid_jax.model.layers import (
    GatedRMSNorm,
    ShortConv,
    a_log_init,
    column_pieces,
    decay_gate,
    dense,
    dt_bias_init,
    dtypes,
    sow,
    torch_default_init,
)
from hybrid_jax.model.mixer import RecurrentMixer, recurrent_impl, sequence_form, zero_padding


class KimiDeltaAttention(RecurrentMixer):
    """KDA mixer on ``x: [B,T,D] -> [B,T,D]``."""

    def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
        c = cfg.kda
        dtype, param_dtype = dtypes(cfg)
        if c.num_value_heads % c.num_key_heads:
            raise ValueError(f"kda.num_value_heads {c.num_value_heads} must be a multiple of {c.num_key_heads}")
        self.hk, self.dk, self.hv, self.dv = c.num_key_heads, c.key_head_dim, c.num_value_heads, c.value_head_dim
        qk, vd = self.hk * self.dk, self.hv * self.dv
        self.in_proj = dense(cfg, cfg.hidden_size, 2 * qk + vd + 2 * self.dv + self.hv, rngs=rngs)
        self.conv1d = ShortConv(2 * qk + vd, c.conv_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs, kernel_impl=cfg.kernel_impl)
        low_rank_init = torch_default_init(self.dv)
        self.f_b_proj = dense(cfg, self.dv, self.hv * self.dk, kernel_init=low_rank_init, rngs=rngs)
        self.g_b_proj = dense(cfg, self.dv, vd, kernel_init=low_rank_init, use_bias=True, bias_init=low_rank_init,
                              rngs=rngs)
        self.A_log = nnx.Param(a_log_init(rngs.params(), (self.hv,), param_dtype))
        self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (self.hv * self.dk,), param_dtype))
        self.out_norm = GatedRMSNorm(self.dv, activation="sigmoid", eps=cfg.norm_eps, dtype=dtype,
                                     param_dtype=param_dtype, kernel_impl=cfg.kernel_impl)
        self.out_proj = dense(cfg, vd, cfg.hidden_size, rngs=rngs)
        self.kernel_impl, self.chunk_size = cfg.kernel_impl, cfg.chunk_size or None
        self.state_shape = (self.hv, self.dk, self.dv)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, context: str | None = None
                 ) -> jax.Array:
        """``segment_ids [B,T]``: packed documents (the state and the short conv restart at each). ``context``: the
        mesh axis the time axis is split over, inside its ``shard_map`` (``hybrid_jax.parallel``)."""
        return self._mix(x, functools.partial(self.plain_conv, segment_ids=segment_ids, context=context),
                         segment_ids=segment_ids, context=context)[0]

    def _mix(self, x: jax.Array, conv, state: jax.Array | None = None, valid: jax.Array | None = None,
             segment_ids: jax.Array | None = None, context: str | None = None):
        """``(y [B,T,D], final state, conv tail)``; ``conv(u) -> (conv output, tail)``; pads (``~valid``) masked."""
        B, T, _ = x.shape
        qk, vd = self.hk * self.dk, self.hv * self.dv
        qkv, fgb = column_pieces(self.in_proj, x, (2 * qk + vd, 2 * self.dv + self.hv))
        f_a, g_a, b = jnp.split(fgb, [self.dv, 2 * self.dv], axis=-1)
        (q, k, v), tail = conv(qkv, ((self.hk, self.dk), (self.hk, self.dk), (self.hv, self.dv)))
        f = self.f_b_proj(f_a).reshape(B, T, self.hv, self.dk)
        g = decay_gate(self.A_log[...][:, None], f, self.dt_bias[...].reshape(self.hv, self.dk))
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        if valid is not None:
            k, g, beta = zero_padding(valid, k, g, beta)
        recurrence = sequence_form(kernels.chunk_kda, context)
        o, state = recurrence(q, k, v, g, beta, initial_state=state, output_final_state=True,
                              use_qk_l2norm=True, chunk_size=self.chunk_size,
                              impl=recurrent_impl(self.kernel_impl, T), segment_ids=segment_ids)
        sow(self, "g", g)
        sow(self, "beta", beta)
        sow(self, "final_state", state)
        z = self.g_b_proj(g_a).reshape(B, T, self.hv, self.dv)  # the output gate is sigmoid(z), in out_norm
        return self.out_proj(self.out_norm(o, z).reshape(B, T, vd)), state, tail
