"""FLA's ``GatedDeltaNetForCausalLM`` forward in plain PyTorch, reading FLA's own tensor names, and random FLA-layout
checkpoints: an independent check of our FLA import's name table without FLA installed.

Written from FLA's layer code (``fla/layers/gated_deltanet.py``, ``fla/models/gated_deltanet``; ``attn_mode``
``chunk``, ``use_gate``, short convs without bias, no negative eigenvalues): embeddings, per layer
``h += attn(attn_norm(h))`` and ``h += mlp(mlp_norm(h))``, final norm, ``lm_head``. The recurrence is the exported
modeling file's token-by-token specification (``modeling_hybrid.recurrence``).
"""

import numpy as np
import torch
import torch.nn.functional as F

from hybrid_jax.export.fla import fla_shapes
from hybrid_jax.export.modeling_hybrid import l2_normalize, recurrence, rms_normalize


def random_fla_tensors(fla_cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of FLA's model for ``fla_cfg`` (names and shapes: ``fla_shapes``), float32: ``1 + N(0, 0.1)``
    norm weights, ``log U(1, 16)`` for ``A_log``, ``N(0, 0.1)`` for everything else (``lm_head`` its own draw)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in fla_shapes(fla_cfg).items():
        if name.endswith("A_log"):
            out[name] = np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        else:
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            out[name] = (rng.normal(0.0, 0.1, shape) + offset).astype(np.float32)
    return out


def fla_gdn_logits(tensors: dict[str, np.ndarray], fla_cfg: dict, ids: np.ndarray) -> np.ndarray:
    """``ids [B, T]`` -> logits ``[B, T, V]`` (float32) of the FLA GDN checkpoint ``tensors`` (FLA names)."""
    w = {k: torch.from_numpy(v) for k, v in tensors.items()}
    H, K, HV = fla_cfg["num_heads"], fla_cfg["head_dim"], fla_cfg["num_v_heads"]
    V, eps = int(K * fla_cfg["expand_v"]), fla_cfg["norm_eps"]
    B, T = ids.shape

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # FLA's RMSNorm
        return rms_normalize(x, eps) * weight

    def short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # ShortConvolution, silu: [B,T,C]
        x = F.pad(x.transpose(1, 2), (weight.shape[-1] - 1, 0))
        return F.silu(F.conv1d(x, weight, groups=weight.shape[0])).transpose(1, 2)

    with torch.no_grad():
        h = w["model.embeddings.weight"][torch.from_numpy(ids).long()]
        for j in range(fla_cfg["num_hidden_layers"]):
            p = {k.removeprefix(f"model.layers.{j}."): v for k, v in w.items() if k.startswith(f"model.layers.{j}.")}
            x = norm(h, p["attn_norm.weight"])
            q, k, v = (short_conv(x @ p[f"attn.{n}_proj.weight"].T, p[f"attn.{n}_conv1d.weight"]) for n in "qkv")
            q, k = (l2_normalize(t.view(B, T, H, K)).repeat_interleave(HV // H, dim=2) for t in (q, k))
            g = -p["attn.A_log"].exp() * F.softplus(x @ p["attn.a_proj.weight"].T + p["attn.dt_bias"])
            beta = torch.sigmoid(x @ p["attn.b_proj.weight"].T)
            o = recurrence(q, k, v.view(B, T, HV, V), g, beta, K**-0.5)
            gate = (x @ p["attn.g_proj.weight"].T).view(B, T, HV, V)
            o = norm(o, p["attn.o_norm.weight"]) * F.silu(gate)  # FusedRMSNormGated, swish
            h = h + o.reshape(B, T, HV * V) @ p["attn.o_proj.weight"].T
            x = norm(h, p["mlp_norm.weight"])
            up = F.silu(x @ p["mlp.gate_proj.weight"].T) * (x @ p["mlp.up_proj.weight"].T)
            h = h + up @ p["mlp.down_proj.weight"].T
        return (norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T).numpy()
