"""Self-contained PyTorch port of a hybrid_jax model (MLA, Gated DeltaNet, KDA, Mamba2, SwiGLU), shipped in exports.

Load an export with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. Pure PyTorch in float32:
runs on CPU with no FLA, Triton or mamba_ssm. The recurrent mixers run the chunked (WY/UT) form of the gated
recurrence, ``chunked_recurrence``; ``recurrence`` is its token-by-token specification (what the tests compare it
against). MLA is plain causal softmax attention. No KV cache: every ``generate`` step re-runs the full forward.

Parameter names mirror the JAX model (``hybrid_jax.model``): ``model.layers.{i}`` is sublayer ``i`` of the layer plan
(one pre-norm residual block per mixer and per MLP, Megatron style), PyTorch layouts (``Linear.weight [out, in]``,
depthwise ``conv1d.weight [C, 1, K]``); the output layer ``lm_head`` is the embedding (``tie_word_embeddings``, the
default) or its own ``[V, D]`` matrix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

L2NORM_EPS = 1e-6


class HybridJaxConfig(PretrainedConfig):
    """``layer_kinds``: one of ``mla | gdn | kda | mamba2 | mlp`` per sublayer; ``gdn``, ``kda``, ``mamba2``, ``mla``:
    the sub-config dicts of ``hybrid_jax.config`` (field names as there)."""

    model_type = "hybrid_jax"

    def __init__(self, vocab_size: int = 512, hidden_size: int = 64, layer_kinds: list[str] | None = None,
                 ffn_size: int = 128, norm_eps: float = 1e-6, gdn: dict | None = None, kda: dict | None = None,
                 mamba2: dict | None = None, mla: dict | None = None, tie_word_embeddings: bool = True, **kwargs):
        self.vocab_size, self.hidden_size, self.ffn_size, self.norm_eps = vocab_size, hidden_size, ffn_size, norm_eps
        self.layer_kinds = list(layer_kinds or ["mla", "mlp"])
        self.num_hidden_layers = len(self.layer_kinds)
        self.gdn, self.kda, self.mamba2, self.mla = gdn or {}, kda or {}, mamba2 or {}, mla or {}
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# --------------------------------------------------------------------------------------------- building blocks
def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis (FLA's ``l2norm``)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def decay_gate(a_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Log decay ``g = -exp(A_log) * softplus(a + dt_bias)``."""
    return -torch.exp(a_log) * F.softplus(a + dt_bias)


class RMSNorm(nn.Module):
    """``rmsnorm(x) * weight`` (``* gate`` when given); ``groups > 1`` normalises each of ``groups`` equal slices."""

    def __init__(self, dim: int, eps: float, groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.groups = eps, groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = rms_normalize(x.reshape(*shape[:-1], self.groups, -1), self.eps).reshape(shape) * self.weight
        return y if gate is None else y * gate


class ShortConv(nn.Conv1d):
    """Depthwise causal conv over time then SiLU. ``weight [C, 1, K]``; ``x: [B, T, C] -> [B, T, C]``."""

    def __init__(self, channels: int, kernel_size: int, bias: bool):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.transpose(1, 2), (self.kernel_size[0] - 1, 0))
        return F.silu(F.conv1d(x, self.weight, self.bias, groups=self.groups)).transpose(1, 2)


def linear(d_in: int, d_out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=bias)


def recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """The gated (delta-rule) linear recurrence, one token at a time, state ``[B, H, K, V]`` from zeros.

    ``q, k: [B,T,H,K]`` (heads already expanded to the value heads), ``v: [B,T,H,V]``, ``g``: log decay ``[B,T,H]``
    (scalar per head) or ``[B,T,H,K]`` (per key channel), ``beta: [B,T,H]`` or ``None`` (no delta rule)::

        S_t = decay(g_t) S_{t-1};  delta: S_t += beta_t k_t (v_t - S_t^T k_t)^T;  else: S_t += k_t v_t^T
        o_t = scale * S_t^T q_t                                          -> o [B,T,H,V]
    """
    B, T, H, K = q.shape
    state = q.new_zeros(B, H, K, v.shape[-1])
    outputs = []
    for t in range(T):
        decay = torch.exp(g[:, t])
        state = state * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        k_t, v_t = k[:, t], v[:, t]
        if beta is None:
            state = state + k_t[..., :, None] * v_t[..., None, :]
        else:
            err = v_t - torch.einsum("bhk,bhkv->bhv", k_t, state)
            state = state + (beta[:, t, :, None] * k_t)[..., :, None] * err[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    return torch.stack(outputs, dim=1)


def segment_sums(g: torch.Tensor, per_key: bool) -> torch.Tensor:
    """``E_ij = sum_{j<s<=i} g_s`` (= ``gamma_i - gamma_j``, ``gamma`` the cumulative log decay) for ``i >= j``, 0
    above the diagonal. ``g: [..., C] -> [..., C, C]``; per key ``[..., C, K] -> [..., C, C, K]``.

    Summing only the gates in between, rather than differencing cumulative sums that reach ``C * |g|``, keeps the
    exponent exact to float32 rounding of its own size, also for strong decays.
    """
    if not per_key:
        return segment_sums(g[..., None], True)[..., 0]
    C, K = g.shape[-2:]
    keep = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)[..., None]  # [s, j, 1]: s > j
    return g[..., :, None, :].expand(*g.shape[:-2], C, C, K).masked_fill(~keep, 0.0).cumsum(-3)


def decayed_scores(a: torch.Tensor, b: torch.Tensor, seg: torch.Tensor, strict: bool) -> torch.Tensor:
    """``S_ij = sum_d a_id b_jd exp(gamma_id - gamma_jd)`` for ``j < i`` (``j <= i`` unless strict), else 0.

    ``a, b: [..., C, K]``; ``seg``: :func:`segment_sums` of the chunk's gates, ``[..., C, C]`` (scalar gate) or
    ``[..., C, C, K]`` (per-key gate: the decay sits inside the K contraction) -> ``[..., C, C]``. The exponent is
    masked to ``-inf`` before ``exp``, so nothing is ever formed from the upper triangle.
    """
    C = a.shape[-2]
    upper = ~torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if seg.dim() == a.dim():
        return (a @ b.transpose(-1, -2)) * torch.exp(seg.masked_fill(upper, float("-inf")))
    decay = torch.exp(seg.masked_fill(upper[..., None], float("-inf")))  # [..., C, C, K]
    return torch.einsum("...id,...jd,...ijd->...ij", a, b, decay)


def chunked_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                       scale: float, chunk_size: int = 64) -> torch.Tensor:
    """The same function as :func:`recurrence` (same shapes, state from zeros), computed chunk by chunk (WY/UT form).

    ``q, k: [B,T,H,K]``, ``v: [B,T,H,V]``, ``g: [B,T,H]`` or ``[B,T,H,K]``, ``beta: [B,T,H]`` or ``None`` ->
    ``o [B,T,H,V]`` in q's dtype. Per chunk of ``C = chunk_size`` tokens with chunk-local cumulative log decay
    ``gamma`` and start state ``S0``::

        A     = strict_lower(beta_i * sum_d k_id k_jd exp(gamma_id - gamma_jd))      (delta rule only)
        u     = (I + A)^-1 (beta * V);   w = (I + A)^-1 (beta * exp(gamma) * K)
        v_new = u - w S0                  (plain GLA: v_new = V)
        o     = scale * [(Q * exp(gamma)) S0 + lower_incl(Q K^T decayed) v_new]
        S1    = exp(gamma_last) S0 + (K * exp(gamma_last - gamma))^T v_new

    Everything that does not depend on ``S0`` is computed for all chunks at once; only the three state products run
    in the loop over chunks. T need not be a multiple of C: the tail is padded with ``k = v = beta = 0`` and
    ``g = 0``, which leaves the state untouched. Computed in float32 (float64 inputs: float64), autocast off.
    """
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    N = -(-T // C)
    dtype = torch.promote_types(q.dtype, torch.float32)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [B,T,H,...] -> [N,B,H,C,...], zero padded to N*C tokens
        x = F.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, N * C - T))
        return x.reshape(B, N, C, *x.shape[2:]).movedim((1, 3), (0, 2)).contiguous()

    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc, gc = to_chunks(q) * scale, to_chunks(k), to_chunks(v), to_chunks(g)
        per_key = g.dim() == 4
        seg = segment_sums(gc, per_key)  # [N,B,H,C,C] or [N,B,H,C,C,K]
        gamma = gc.cumsum(3)[..., None] if not per_key else gc.cumsum(3)  # [N,B,H,C,1] or [N,B,H,C,K]
        to_end = seg[..., -1, :, None] if not per_key else seg[..., -1, :, :]  # gamma_last - gamma, as gamma
        q_decayed, k_to_end = qc * torch.exp(gamma), kc * torch.exp(to_end)
        state_decay = torch.exp(gamma[:, :, :, -1:]).transpose(-1, -2)  # [N,B,H,K,1] or [N,B,H,1,1]
        scores = decayed_scores(qc, kc, seg, strict=False)  # [N,B,H,C,C]
        if beta is None:
            u, w = vc, None
        else:
            bc = to_chunks(beta)[..., None]  # [N,B,H,C,1]
            eye_plus_a = torch.eye(C, dtype=dtype, device=q.device) + bc * decayed_scores(kc, kc, seg, strict=True)
            u, w = (torch.linalg.solve_triangular(eye_plus_a, bc * rhs, upper=False, unitriangular=True)
                    for rhs in (vc, kc * torch.exp(gamma)))
        state = qc.new_zeros(B, H, K, V)
        outputs = []
        for n in range(N):
            v_new = u[n] if w is None else u[n] - w[n] @ state
            outputs.append(q_decayed[n] @ state + scores[n] @ v_new)
            state = state_decay[n] * state + k_to_end[n].transpose(-1, -2) @ v_new
        o = torch.stack(outputs).movedim((0, 2), (1, 3)).reshape(B, N * C, H, V)[:, :T]
    return o.to(q.dtype)


# --------------------------------------------------------------------------------------------- sublayers
class MLP(nn.Module):
    """SwiGLU: ``linear_fc2(silu(gate) * up)``, ``[gate | up] = linear_fc1(x)``."""

    def __init__(self, cfg: HybridJaxConfig):
        super().__init__()
        self.linear_fc1 = linear(cfg.hidden_size, 2 * cfg.ffn_size)
        self.linear_fc2 = linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


def rope_frequencies(m: dict) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dr/2], magnitude)``: plain RoPE, or YaRN (DeepSeek/Megatron form) when the factor is > 1."""
    dim, base, factor = m["qk_rope_head_dim"], m["rope_theta"], m["rope_scaling_factor"]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if factor <= 1.0:
        return inv_freq, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(m["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def mscale(scale: float) -> float:
        return 0.1 * scale * math.log(factor) + 1.0

    low = max(math.floor(correction_dim(m["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(m["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1.0 - ramp)
    return inv_freq, mscale(m["mscale"]) / mscale(m["mscale_all_dim"])


def apply_rope(x: torch.Tensor, inv_freq: torch.Tensor, magnitude: float) -> torch.Tensor:
    """Rotate-half RoPE at positions ``0..T-1`` on ``x: [B,T,H,dr]`` (channel ``i`` pairs with ``i + dr/2``)."""
    angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    cos, sin = (torch.cos(angles) * magnitude)[None, :, None, :], (torch.sin(angles) * magnitude)[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLA(nn.Module):
    """Multi-head Latent Attention, causal; low-rank q and kv with RMSNorm on the latents, rope on a shared k part."""

    def __init__(self, cfg: HybridJaxConfig):
        super().__init__()
        m, D = cfg.mla, cfg.hidden_size
        self.h, self.nope, self.rope, self.dv, self.kv_rank = (m["num_heads"], m["qk_nope_head_dim"],
                                                               m["qk_rope_head_dim"], m["v_head_dim"],
                                                               m["kv_lora_rank"])
        self.linear_q_down_proj = linear(D, m["q_lora_rank"])
        self.q_layernorm = RMSNorm(m["q_lora_rank"], cfg.norm_eps)
        self.linear_q_up_proj = linear(m["q_lora_rank"], self.h * (self.nope + self.rope))
        self.linear_kv_down_proj = linear(D, self.kv_rank + self.rope)
        self.kv_layernorm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.linear_kv_up_proj = linear(self.kv_rank, self.h * (self.nope + self.dv))
        self.linear_proj = linear(self.h * self.dv, D)
        self.rope_cfg = dict(m)  # frequencies are computed in forward: no buffer to lose in meta-device loading
        factor = m["rope_scaling_factor"]
        mscale = 1.0 if factor <= 1.0 else 0.1 * m["mscale_all_dim"] * math.log(factor) + 1.0
        self.scale = mscale**2 / math.sqrt(self.nope + self.rope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        inv_freq, magnitude = rope_frequencies(self.rope_cfg)
        q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x))).view(B, T, self.h, -1)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_rank, self.rope], dim=-1)
        k_nope, v = self.linear_kv_up_proj(self.kv_layernorm(latent)).view(B, T, self.h, -1).split(
            [self.nope, self.dv], dim=-1)
        q = torch.cat([q[..., : self.nope], apply_rope(q[..., self.nope :], inv_freq, magnitude)], dim=-1)
        k_rope = apply_rope(k_rope[:, :, None, :], inv_freq, magnitude).expand(B, T, self.h, self.rope)
        k = torch.cat([k_nope, k_rope], dim=-1)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.linear_proj(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, self.h * self.dv))


class GatedDeltaNet(nn.Module):
    """GDN: ``[q|k|v|z|b|a] = in_proj(x)``, conv+SiLU on q|k|v, delta rule with scalar decay, ``rmsnorm(o)*silu(z)``."""

    def __init__(self, cfg: HybridJaxConfig):
        super().__init__()
        c = cfg.gdn
        self.hk, self.dk, self.hv, self.dv = c["num_key_heads"], c["key_head_dim"], c["num_value_heads"], \
            c["value_head_dim"]
        qk, vd = self.hk * self.dk, self.hv * self.dv
        self.in_proj = linear(cfg.hidden_size, 2 * qk + 2 * vd + 2 * self.hv)
        self.conv1d = ShortConv(2 * qk + vd, c["conv_size"], bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.zeros(self.hv))
        self.out_norm = RMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = linear(vd, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qk, vd = self.hk * self.dk, self.hv * self.dv
        qkv, z, b, a = self.in_proj(x).split([2 * qk + vd, vd, self.hv, self.hv], dim=-1)
        q, k, v = self.conv1d(qkv).split([qk, qk, vd], dim=-1)
        group = self.hv // self.hk
        q = l2_normalize(q.view(B, T, self.hk, self.dk)).repeat_interleave(group, dim=2)
        k = l2_normalize(k.view(B, T, self.hk, self.dk)).repeat_interleave(group, dim=2)
        o = chunked_recurrence(q, k, v.view(B, T, self.hv, self.dv), decay_gate(self.A_log, a, self.dt_bias),
                               torch.sigmoid(b), self.dk**-0.5)
        return self.out_proj(self.out_norm(o, F.silu(z).view(B, T, self.hv, self.dv)).reshape(B, T, vd))


class KimiDeltaAttention(nn.Module):
    """KDA: like GDN with a per-key-channel decay from a low-rank ``f`` path and a sigmoid output gate."""

    def __init__(self, cfg: HybridJaxConfig):
        super().__init__()
        c = cfg.kda
        self.hk, self.dk, self.hv, self.dv = c["num_key_heads"], c["key_head_dim"], c["num_value_heads"], \
            c["value_head_dim"]
        qk, vd = self.hk * self.dk, self.hv * self.dv
        self.in_proj = linear(cfg.hidden_size, 2 * qk + vd + 2 * self.dv + self.hv)
        self.conv1d = ShortConv(2 * qk + vd, c["conv_size"], bias=False)
        self.f_b_proj = linear(self.dv, self.hv * self.dk)
        self.g_b_proj = linear(self.dv, vd, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.zeros(self.hv * self.dk))
        self.out_norm = RMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = linear(vd, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qk, vd = self.hk * self.dk, self.hv * self.dv
        qkv, f_a, g_a, b = self.in_proj(x).split([2 * qk + vd, self.dv, self.dv, self.hv], dim=-1)
        q, k, v = self.conv1d(qkv).split([qk, qk, vd], dim=-1)
        group = self.hv // self.hk
        q = l2_normalize(q.view(B, T, self.hk, self.dk)).repeat_interleave(group, dim=2)
        k = l2_normalize(k.view(B, T, self.hk, self.dk)).repeat_interleave(group, dim=2)
        g = decay_gate(self.A_log[:, None], self.f_b_proj(f_a).view(B, T, self.hv, self.dk),
                       self.dt_bias.view(self.hv, self.dk))
        # chunk 16: the per-key decay tensor [.., C, C, K] holds T * C * K numbers per head
        o = chunked_recurrence(q, k, v.view(B, T, self.hv, self.dv), g, torch.sigmoid(b), self.dk**-0.5, chunk_size=16)
        gate = torch.sigmoid(self.g_b_proj(g_a)).view(B, T, self.hv, self.dv)
        return self.out_proj(self.out_norm(o, gate).reshape(B, T, vd))


class Mamba2(nn.Module):
    """Mamba2 (SSD): ``[z|x|B|C|dt] = in_proj(u)``, conv(+bias)+SiLU on x|B|C, scalar-decay recurrence, ``+ D x``,
    gate-then-norm ``rmsnorm_group(y * silu(z))``."""

    def __init__(self, cfg: HybridJaxConfig):
        super().__init__()
        c = cfg.mamba2
        self.d_in = c["expand"] * cfg.hidden_size
        self.p, self.nh, self.g, self.n = c["head_dim"], self.d_in // c["head_dim"], c["num_groups"], c["state_dim"]
        bc = 2 * self.g * self.n
        self.in_proj = linear(cfg.hidden_size, 2 * self.d_in + bc + self.nh)
        self.conv1d = ShortConv(self.d_in + bc, c["conv_size"], bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.nh))
        self.dt_bias = nn.Parameter(torch.zeros(self.nh))
        self.D = nn.Parameter(torch.ones(self.nh))
        self.norm = RMSNorm(self.d_in, c["norm_eps"], groups=self.g)
        self.out_proj = linear(self.d_in, cfg.hidden_size)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        B, T, _ = u.shape
        gn = self.g * self.n
        z, xbc, dt = self.in_proj(u).split([self.d_in, self.d_in + 2 * gn, self.nh], dim=-1)
        x, b, c = self.conv1d(xbc).split([self.d_in, gn, gn], dim=-1)
        x = x.view(B, T, self.nh, self.p)
        group = self.nh // self.g
        b = b.view(B, T, self.g, self.n).repeat_interleave(group, dim=2)
        c = c.view(B, T, self.g, self.n).repeat_interleave(group, dim=2)
        dt = F.softplus(dt + self.dt_bias)  # [B,T,nh]
        y = chunked_recurrence(c, b, dt[..., None] * x, -torch.exp(self.A_log) * dt, None, 1.0)
        y = y + self.D[:, None] * x
        return self.out_proj(self.norm(y.reshape(B, T, self.d_in) * F.silu(z)))


SUBLAYERS = {"mla": ("self_attention", MLA), "gdn": ("mixer", GatedDeltaNet), "kda": ("mixer", KimiDeltaAttention),
             "mamba2": ("mixer", Mamba2), "mlp": ("mlp", MLP)}


class Sublayer(nn.Module):
    """One pre-norm residual block ``x + f(norm(x))``."""

    def __init__(self, kind: str, cfg: HybridJaxConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.block_name, block = SUBLAYERS[kind]
        self.add_module(self.block_name, block(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + getattr(self, self.block_name)(self.norm(x))


# --------------------------------------------------------------------------------------------- models
class HybridJaxPreTrainedModel(PreTrainedModel):
    config_class = HybridJaxConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """Only used for weights missing from a checkpoint (there should be none): normal(0, 0.02) matrices."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


class HybridJaxModel(HybridJaxPreTrainedModel):
    """Embedding -> sublayers -> final norm. ``input_ids [B,T] -> hidden [B,T,D]``."""

    def __init__(self, config: HybridJaxConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Sublayer(kind, config) for kind in config.layer_kinds)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids).float()
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class HybridJaxForCausalLM(HybridJaxPreTrainedModel, GenerationMixin):
    """Causal LM; ``lm_head`` is tied to the embedding when ``config.tie_word_embeddings``. ``input_ids [B,T] ->
    logits [B,T,V]`` float32.

    ``attention_mask`` is accepted and ignored: the model is causal, so right padding never changes real positions.
    """

    # transformers 5 form (4 reads the keys); only applied when config.tie_word_embeddings
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridJaxConfig):
        super().__init__(config)
        self.model = HybridJaxModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs) -> dict:
        return {"input_ids": input_ids}

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

