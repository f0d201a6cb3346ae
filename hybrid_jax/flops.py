"""Training FLOPs per token of a model config, and the peak FLOP/s of a device (for MFU).

One formula, used by the trainer's logs and the benchmarks. Per token, forward pass:

* **Projections**: ``2 x`` every weight matrix applied per token, i.e. ``2 x`` the number of parameters with
  two or more dimensions other than the embedding and the output layer (all linear layers, the low-rank gates, the
  depthwise convs: a ``[k, C]`` conv is ``k C`` multiply-adds per token), read from the model's abstract parameters.
* **LM head**: ``2 V D`` (the output layer, tied embedding or untied ``lm_head``; the input lookup is free).
* **Attention** (each MLA sublayer, sequence ``T``): ``2 H (d_qk + d_v) T`` for scores and values, halved
  because it is causal: ``H (d_qk + d_v) T`` with ``d_qk = qk_nope + qk_rope``.
* **Chunked recurrences** (each mixer, chunk ``C``, per value head with key dim ``K`` and value dim ``V``):
  the delta rule (GDN, KDA) costs ``6 K V`` for the state terms (``q S``, ``w S``, the ``k^T u`` update)
  plus ``2 C (K + V)`` for the causal intra-chunk products (``Q K^T``, ``K K^T``, ``A V``, ``A U``, halved);
  the scalar-gated form (Mamba2 SSD: ``K = state_dim``, ``V = head_dim``, one head per ``head_dim`` channels)
  costs ``4 K V + C (K + V)``.

Training = ``3 x`` forward (backward = 2 x forward). Element-wise work (norms, gates, softmax) is not counted,
and nothing is inflated Megatron-style (see the README): MFU = achieved training FLOP/s / peak dense bf16
FLOP/s of the device.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.model.plan import sublayer_kinds

# Peak dense bf16 FLOP/s per device, matched against ``device.device_kind`` (first match wins).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("MI355", 2300e12),
    ("gfx950", 2300e12),
    ("MI300", 1307e12),
    ("MI325", 1307e12),
    ("gfx942", 1307e12),
)


def matrix_params(model_cfg: ConfigDict) -> int:
    """Parameters in weight matrices (ndim >= 2) other than the embedding and an untied ``lm_head`` (the LM head term
    counts the output layer), from the abstract model (no allocation)."""
    from hybrid_jax.model import HybridLM

    abstract = nnx.eval_shape(lambda: HybridLM(model_cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if len(leaf.shape) >= 2 and not name.startswith(("embed", "lm_head")):
            total += int(np.prod(leaf.shape))
    return total


def mixer_flops_per_token(kind: str, model_cfg: ConfigDict, seq_len: int) -> float:
    """Forward FLOPs per token of one sublayer's attention or recurrence core (projections excluded)."""
    c = model_cfg.chunk_size
    if kind == "mla":
        m = model_cfg.mla
        return m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * seq_len
    if kind in ("gdn", "kda"):
        m = model_cfg[kind]
        k, v = m.key_head_dim, m.value_head_dim
        return m.num_value_heads * (6 * k * v + 2 * c * (k + v))
    if kind == "mamba2":
        m = model_cfg.mamba2
        heads = m.expand * model_cfg.hidden_size // m.head_dim
        k, v = m.state_dim, m.head_dim
        return heads * (4 * k * v + c * (k + v))
    return 0.0


def flops_per_token(model_cfg: ConfigDict, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token of ``model_cfg`` at sequence length ``seq_len``."""
    forward = 2 * matrix_params(model_cfg) + 2 * model_cfg.vocab_size * model_cfg.hidden_size
    forward += sum(mixer_flops_per_token(kind, model_cfg, seq_len) for kind in sublayer_kinds(model_cfg))
    return 3.0 * forward


def peak_flops(device: jax.Device) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``, or None when unknown (CPU): MFU is then not reported."""
    kind = device.device_kind
    return next((peak for key, peak in PEAK_FLOPS if key.lower() in kind.lower()), None)
