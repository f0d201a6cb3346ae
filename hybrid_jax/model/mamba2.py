"""Mamba2 mixer (Megatron ``MambaMixer`` / mamba_ssm ``Mamba2``), SSD through the scalar-gated linear-attention kernel.

With ``d_in = expand * D``, ``nh = d_in / head_dim`` SSM heads, ``G`` groups and state size ``N``::

    [z | x | B | C | dt] = in_proj(u)                z, x: d_in;  B, C: G*N;  dt: nh
    [x | B | C] = silu(conv1d([x | B | C]))           depthwise causal, kernel conv_size, WITH bias
    dt = softplus(dt + dt_bias);  A = -exp(A_log)     (float32)
    y, S = chunk_simple_gla(q=C, k=B, v=dt*x, g=dt*A, scale=1)   one kernel q/k head per group: B, C are not repeated
    y = y + D[h] * x                                  float32, rounded to the compute dtype (as mamba_ssm writes it)
    out = out_proj(norm(y, z))                        rmsnorm_group(y * silu(z)) * w, group size d_in/G, gate first

``z``, ``[x | B | C]`` and ``dt`` are three matmuls on in_proj's columns, and the conv's output three arrays: no
copy slices the projection or the conv's output, and no concatenation joins their gradients.

The sublayer gets a pre-norm like every other sublayer (Primus's no-TE Mamba spec has none, its converter emits a
ones ``mixer_norm`` for it). Sown intermediates: ``dt [B,T,nh]`` (float32), ``final_state [B,nh,N,head_dim]``.
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
    dense,
    dt_bias_init,
    dtypes,
    sow,
)
from hybrid_jax.model.mixer import RecurrentMixer, recurrent_impl, sequence_form, zero_padding


class Mamba2(RecurrentMixer):
    """Mamba2 mixer on ``u: [B,T,D] -> [B,T,D]``."""

    def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
        c = cfg.mamba2
        dtype, param_dtype = dtypes(cfg)
        self.d_in = c.expand * cfg.hidden_size
        if self.d_in % c.head_dim:
            raise ValueError(f"model.hidden_size={cfg.hidden_size} x model.mamba2.expand={c.expand} = {self.d_in} is "
                             f"not a multiple of model.mamba2.head_dim={c.head_dim}")
        self.head_dim, self.nheads = c.head_dim, self.d_in // c.head_dim
        self.groups, self.state = c.num_groups, c.state_dim
        if self.nheads % self.groups:
            raise ValueError(f"model.mamba2: {self.nheads} heads (hidden_size x expand / head_dim) are not a multiple "
                             f"of model.mamba2.num_groups={self.groups}")
        bc = 2 * self.groups * self.state
        self.in_proj = dense(cfg, cfg.hidden_size, 2 * self.d_in + bc + self.nheads, rngs=rngs)
        self.conv1d = ShortConv(self.d_in + bc, c.conv_size, use_bias=True, dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs, kernel_impl=cfg.kernel_impl)
        self.A_log = nnx.Param(a_log_init(rngs.params(), (self.nheads,), param_dtype))
        self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (self.nheads,), param_dtype))
        self.D = nnx.Param(jnp.ones((self.nheads,), param_dtype))
        self.norm = GatedRMSNorm(self.d_in, groups=self.groups, gate_first=True, eps=c.norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, kernel_impl=cfg.kernel_impl)
        self.out_proj = dense(cfg, self.d_in, cfg.hidden_size, rngs=rngs)
        self.kernel_impl, self.chunk_size, self.dtype = cfg.kernel_impl, cfg.chunk_size or None, dtype
        self.state_shape = (self.nheads, self.state, self.head_dim)  # SSD: k = B (state_dim), v = dt*x

    def __call__(self, u: jax.Array, segment_ids: jax.Array | None = None, context: str | None = None
                 ) -> jax.Array:
        """``segment_ids [B,T]``: packed documents (the state and the short conv restart at each). ``context``: the
        mesh axis the time axis is split over, inside its ``shard_map`` (``hybrid_jax.parallel``)."""
        return self._mix(u, functools.partial(self.plain_conv, segment_ids=segment_ids, context=context),
                         segment_ids=segment_ids, context=context)[0]

    def _mix(self, u: jax.Array, conv, state: jax.Array | None = None, valid: jax.Array | None = None,
             segment_ids: jax.Array | None = None, context: str | None = None):
        """``(y [B,T,D], final state, conv tail)``; ``conv(xbc) -> (conv output, tail)``; pads get ``dt = B = 0``."""
        Bsz, T, _ = u.shape
        z, xbc, dt = column_pieces(self.in_proj, u, (self.d_in, self.d_in + 2 * self.groups * self.state, self.nheads))
        (x, b, c), tail = conv(xbc, ((self.nheads, self.head_dim), (self.groups, self.state),
                                     (self.groups, self.state)))
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))  # [B,T,nh]
        if valid is not None:
            b, dt = zero_padding(valid, b, dt)
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        v = (dt[..., None] * x.astype(jnp.float32)).astype(self.dtype)
        recurrence = sequence_form(kernels.chunk_simple_gla, context)
        y, state = recurrence(c, b, v, dt * a, scale=1.0, initial_state=state, output_final_state=True,
                              chunk_size=self.chunk_size, impl=recurrent_impl(self.kernel_impl, T),
                              segment_ids=segment_ids)
        sow(self, "dt", dt)
        sow(self, "final_state", state)
        y = y.astype(jnp.float32) + self.D[...].astype(jnp.float32)[:, None] * x.astype(jnp.float32)
        y = y.astype(self.dtype)
        return self.out_proj(self.norm(y.reshape(Bsz, T, self.d_in), z)), state, tail
