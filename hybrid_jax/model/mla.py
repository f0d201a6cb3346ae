"""Multi-head Latent Attention (Megatron ``MLASelfAttention`` / FLA ``MultiheadLatentAttention``), causal.

With ``H`` heads, ``dn`` = qk_nope_head_dim, ``dr`` = qk_rope_head_dim, ``dv`` = v_head_dim::

    q            = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))      -> [B,T,H,dn+dr] = [q_nope | q_rope]
    [c | k_rope] = linear_kv_down_proj(x)                                     c: [B,T,kv_lora_rank], k_rope: [B,T,dr]
    kv           = linear_kv_up_proj(kv_layernorm(c))                         -> [B,T,H,dn+dv] = [k_nope | v]
    q = [q_nope | rope(q_rope)];  k = [k_nope | rope(k_rope) (shared by all heads)]
    o = linear_proj(softmax(q k^T * mscale^2 / sqrt(dn+dr), causal) v)        [B,T,H*dv] -> [B,T,D]

RoPE convention: FLA's rotate-half on the rope channels as stored (``[x1 | x2]`` halves, channel ``i`` pairs with
``i + dr/2``). Megatron first reorders the rope channels to ``[even | odd]``; a Megatron checkpoint therefore maps to
ours by permuting the rope rows of ``linear_q_up_proj`` (per head) and of ``k_rope`` with ``cat(w[0::2], w[1::2])``.
YaRN (DeepSeek/Megatron form) is used when ``rope_scaling_factor > 1``; factor 1 is exactly plain RoPE.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax import kernels
from hybrid_jax.model.cache import MLACache
from hybrid_jax.model.layers import RMSNorm, dense, dtypes, sow
from hybrid_jax.parallel import shards


# --------------------------------------------------------------------------------------------- RoPE / YaRN
def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(factor) + 1`` for ``factor > 1``, else 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(mla: ConfigDict) -> tuple[np.ndarray, float]:
    """``(inv_freq [dr/2] float64, cos/sin magnitude)`` for the MLA rope dim, plain RoPE or YaRN."""
    dim, base, factor = mla.qk_rope_head_dim, mla.rope_theta, mla.rope_scaling_factor
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factor <= 1.0:
        return inv_freq, 1.0

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(mla.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(mla.beta_fast)), 0)
    high = min(math.ceil(correction_dim(mla.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate by `factor`
    inv_freq = inv_freq / factor * (1.0 - extrapolate) + inv_freq * extrapolate
    return inv_freq, yarn_mscale(factor, mla.mscale) / yarn_mscale(factor, mla.mscale_all_dim)


def apply_rope(x: jax.Array, inv_freq: np.ndarray, magnitude: float, positions: jax.Array | None = None) -> jax.Array:
    """Rotate-half RoPE at ``positions [B,T]`` (default ``0..T-1``). ``x: [B,T,H,dr]`` -> same shape and dtype."""
    positions = jnp.arange(x.shape[1])[None, :] if positions is None else positions
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B|1, T, dr/2]
    cos = (jnp.cos(angles) * magnitude)[:, :, None, :]
    sin = (jnp.sin(angles) * magnitude)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# --------------------------------------------------------------------------------------------- module
class MLA(nnx.Module):
    """Causal MLA on ``x: [B,T,D] -> [B,T,D]``. Sows the attention map ``[B,H,T,T]`` only if ``capture_attention``."""

    def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
        m = cfg.mla
        dtype, param_dtype = dtypes(cfg)
        D, H = cfg.hidden_size, m.num_heads
        self.num_heads, self.nope, self.rope, self.v_dim = H, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        if self.rope % 2:
            raise ValueError(f"mla.qk_rope_head_dim must be even, got {self.rope}")
        self.linear_q_down_proj = dense(cfg, D, m.q_lora_rank, rngs=rngs)
        self.q_layernorm = RMSNorm(m.q_lora_rank, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.linear_q_up_proj = dense(cfg, m.q_lora_rank, H * (self.nope + self.rope), rngs=rngs)
        self.linear_kv_down_proj = dense(cfg, D, m.kv_lora_rank + self.rope, rngs=rngs)
        self.kv_layernorm = RMSNorm(m.kv_lora_rank, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.linear_kv_up_proj = dense(cfg, m.kv_lora_rank, H * (self.nope + self.v_dim), rngs=rngs)
        self.linear_proj = dense(cfg, H * self.v_dim, D, rngs=rngs)
        inv_freq, self.rope_magnitude = rope_frequencies(m)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static (hashable) module attribute
        self.softmax_scale = yarn_mscale(m.rope_scaling_factor, m.mscale_all_dim) ** 2 / math.sqrt(
            self.nope + self.rope)
        self.kernel_impl = cfg.kernel_impl
        self.reset_positions = bool(cfg.get("reset_positions", False))
        self.capture_attention = False

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, context: str | None = None) -> jax.Array:
        """``segment_ids [B,T]``: packed documents, each attends only to itself (and, with
        ``model.reset_positions``, its RoPE positions start at 0). ``context``: the mesh axis the time axis is split
        over, inside its ``shard_map`` (:meth:`context_parallel`)."""
        if context is not None:
            return self.context_parallel(x, segment_ids, context)
        B, T, _ = x.shape
        H, inv_freq = self.num_heads, np.asarray(self.inv_freq)
        positions = document_positions(segment_ids) if segment_ids is not None and self.reset_positions else None
        q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x))).reshape(B, T, H, -1)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        latent_rope = self.linear_kv_down_proj(x)
        latent, k_rope = latent_rope[..., : self.kv_lora_rank], latent_rope[..., self.kv_lora_rank :]
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent)).reshape(B, T, H, -1)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        q_rope = apply_rope(q_rope, inv_freq, self.rope_magnitude, positions)
        k_rope = jnp.broadcast_to(apply_rope(k_rope[:, :, None, :], inv_freq, self.rope_magnitude, positions),
                                  (B, T, H, self.rope))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        o = kernels.attention(q, k, v, causal=True, scale=self.softmax_scale, impl=self.kernel_impl,
                              segment_ids=segment_ids)
        if self.capture_attention:
            sow(self, "attention", causal_attention_map(q, k, self.softmax_scale, segment_ids))
        return self.linear_proj(o.reshape(B, T, H * self.v_dim))

    def context_parallel(self, x: jax.Array, segment_ids: jax.Array | None, context: str) -> jax.Array:
        """This shard's ``x [B,T_local,D] -> [B,T_local,D]`` with the sequence split over the mesh axis ``context``:
        the normed latent and the rotated rope key (``kv_lora_rank + qk_rope_head_dim`` per token) are all-gathered,
        every shard forms the whole sequence's keys and values from them, and its queries attend causally over them at
        their global positions (``kernels.attention`` with ``q_offset``: the flash kernel for the Pallas impls, which
        visits only the key blocks up to each query block's last position), the causal work balanced over the shards
        (:meth:`_context`). No attention map is sown."""
        return self._context(x, segment_ids, context)[0]

    def context_prefill(self, x: jax.Array, segment_ids: jax.Array | None, max_len: int, context: str
                        ) -> tuple[jax.Array, MLACache]:
        """:meth:`context_parallel`, plus the cache after the whole sequence of ``S = n T_local`` tokens: its gathered
        latents and rope keys at positions ``[0, S)`` of ``max_len`` (the same on every shard)."""
        y, whole = self._context(x, segment_ids, context)
        pad = ((0, 0), (0, max_len - whole.shape[1]), (0, 0))
        dtype = self.kv_layernorm.dtype
        return y, MLACache(jnp.pad(whole[..., : self.kv_lora_rank], pad).astype(dtype),
                           jnp.pad(whole[..., self.kv_lora_rank :], pad).astype(dtype))

    def _context(self, x: jax.Array, segment_ids: jax.Array | None, context: str) -> tuple[jax.Array, jax.Array]:
        """``(y [B,T_local,D], the gathered [normed latent | rotated rope key] [B,S,kv_lora_rank+dr])``.

        The causal work is balanced over the shards: shard ``i`` of ``n`` attends from the first half of its own
        tokens and from the second half of shard ``n-1-i``'s (whose inputs and positions it receives, and to which it
        sends the outputs back: two ``ppermute`` of ``[B,T_local/2,D]``), so every shard's queries see about
        ``n T_local / 2`` keys on average instead of ``(i + 1/2) T_local`` (the last shard twice the mean)."""
        B, T, _ = x.shape
        if T % 2:
            raise ValueError(f"context parallel MLA: a shard of {T} tokens, an odd number; it needs halves (make the "
                             "sequence length over the context size even)")
        H, r, inv_freq = self.num_heads, self.kv_lora_rank, np.asarray(self.inv_freq)
        whole_ids = None if segment_ids is None else shards.gather_time(segment_ids, context)  # [B,S]
        rope_positions = jnp.broadcast_to(shards.global_positions(T, context)[None], (B, T))
        if segment_ids is not None and self.reset_positions:
            rope_positions = shards.local_part(document_positions(whole_ids), T, context)
        latent_rope = self.linear_kv_down_proj(x)
        latent = self.kv_layernorm(latent_rope[..., :r])
        k_rope = apply_rope(latent_rope[:, :, None, r:], inv_freq, self.rope_magnitude, rope_positions)[:, :, 0]
        whole = shards.gather_time(jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1), context)
        S = whole.shape[1]
        kv = self.linear_kv_up_proj(whole[..., :r]).reshape(B, S, H, -1)
        k_rope = jnp.broadcast_to(whole[:, :, None, r:].astype(kv.dtype), (B, S, H, self.rope))
        k, v = jnp.concatenate([kv[..., : self.nope], k_rope], axis=-1), kv[..., self.nope :]

        def attend(x_part: jax.Array, positions: jax.Array, offset: jax.Array) -> jax.Array:
            """``x_part [B,t,D]`` at rope ``positions [B,t]``, the tokens from ``offset`` on -> ``[B,t,D]``."""
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x_part)))
            q = q.reshape(*x_part.shape[:2], H, -1)
            q_rope = apply_rope(q[..., self.nope :], inv_freq, self.rope_magnitude, positions)
            q = jnp.concatenate([q[..., : self.nope], q_rope], axis=-1)
            o = kernels.attention(q, k, v, causal=True, scale=self.softmax_scale, impl=self.kernel_impl,
                                  segment_ids=whole_ids, q_offset=offset)
            return self.linear_proj(o.reshape(*x_part.shape[:2], -1))

        i, n, half = shards.shard_index(context), shards.shard_count(context), T // 2
        own = attend(x[:, :half], rope_positions[:, :half], i * T)
        x_mirror, positions_mirror = shards.swap_mirror((x[:, half:], rope_positions[:, half:]), context)
        mirror = attend(x_mirror, positions_mirror, (n - 1 - i) * T + half)
        return jnp.concatenate([own, shards.swap_mirror(mirror, context)], axis=1), whole

    def init_cache(self, batch: int, max_len: int) -> MLACache:
        """Zero latent ``[B,S,kv_lora_rank]`` and rope key ``[B,S,qk_rope_head_dim]`` for ``S = max_len``."""
        dtype = self.kv_layernorm.dtype
        return MLACache(jnp.zeros((batch, max_len, self.kv_lora_rank), dtype),
                        jnp.zeros((batch, max_len, self.rope), dtype))

    def extend(self, x: jax.Array, n: jax.Array, pos: jax.Array, cache: MLACache, start: jax.Array
               ) -> tuple[jax.Array, MLACache]:
        """Attend from ``x [B,T,D]`` at positions ``pos[b] + t`` over the cache's positions ``[start[b], pos[b] + t]``
        (``start [B]``: the current document's first position; RoPE counts from it with ``model.reset_positions``),
        absorbed-projection form.

        The new latents and rope keys are written at those positions first (pad steps beyond ``n`` too: later
        tokens overwrite them before any query can see them). ``k_nope`` is folded into the query and ``v`` into the
        output through ``linear_kv_up_proj``'s kernel ``[r, H, dn + dv]``, so per-head K/V are never formed::

            score[s] = (q_nope W_uk^T) . latent[s] + q_rope . k_rope[s];   o = (softmax(score) latent) W_uv
        """
        B, T, _ = x.shape
        H, r, inv_freq = self.num_heads, self.kv_lora_rank, np.asarray(self.inv_freq)
        positions = pos[:, None] + jnp.arange(T)[None, :]  # [B,T]
        rope_positions = positions - start[:, None] if self.reset_positions else positions
        q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x))).reshape(B, T, H, -1)
        q_nope = q[..., : self.nope].astype(jnp.float32)
        q_rope = apply_rope(q[..., self.nope :], inv_freq, self.rope_magnitude, rope_positions).astype(jnp.float32)
        latent_rope = self.linear_kv_down_proj(x)
        latent = self.kv_layernorm(latent_rope[..., :r])
        k_rope = apply_rope(latent_rope[:, :, None, r:], inv_freq, self.rope_magnitude, rope_positions)[:, :, 0]
        rows = jnp.arange(B)[:, None]
        cache = MLACache(cache.latent.at[rows, positions].set(latent.astype(cache.latent.dtype)),
                         cache.k_rope.at[rows, positions].set(k_rope.astype(cache.k_rope.dtype)))
        w = self.linear_kv_up_proj.kernel[...].astype(jnp.float32).reshape(r, H, self.nope + self.v_dim)
        c, kr = cache.latent.astype(jnp.float32), cache.k_rope.astype(jnp.float32)
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w[..., : self.nope])
        scores = (jnp.einsum("bthr,bsr->bhts", q_latent, c) + jnp.einsum("bthd,bsd->bhts", q_rope, kr))
        keys = jnp.arange(c.shape[1])[None, None, :]
        visible = (keys <= positions[:, :, None]) & (keys >= start[:, None, None])  # [B,T,S]
        p = jax.nn.softmax(jnp.where(visible[:, None], scores * self.softmax_scale, -jnp.inf), axis=-1)
        o = jnp.einsum("bthr,rhv->bthv", jnp.einsum("bhts,bsr->bthr", p, c), w[..., self.nope :])
        return self.linear_proj(o.reshape(B, T, H * self.v_dim).astype(x.dtype)), cache


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """``[B,T]`` int32: each token's position within its document (``segment_ids [B,T]`` nondecreasing)."""
    B, T = segment_ids.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    new = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return pos - jax.lax.cummax(jnp.where(new, pos, 0), axis=1)


def causal_attention_map(q: jax.Array, k: jax.Array, scale: float, segment_ids: jax.Array | None = None
                         ) -> jax.Array:
    """Softmax attention probabilities ``[B,H,T,T]`` (float32) of ``q, k: [B,T,H,d]``, causal (and within each
    document of ``segment_ids [B,T]``)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    T = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    if segment_ids is not None:
        s = jnp.where(segment_ids[:, None, :, None] == segment_ids[:, None, None, :], s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1)
