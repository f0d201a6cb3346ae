"""HF format for every model (hybrids included): the self-contained ``modeling_hybrid.py`` and its state dict.

Names mirror ours: ``embed.embedding -> model.embed_tokens.weight``, ``final_norm.weight -> model.norm.weight``,
``layers.{i}.X -> model.layers.{i}.X`` with ``kernel -> weight`` (Linear: transposed to ``[out, in]``; conv
``[K, C] -> [C, 1, K]``). The output layer is tied (``lm_head.weight`` is not stored).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.model.plan import sublayer_kinds

MODELING_FILE = Path(__file__).with_name("modeling_hybrid.py")
AUTO_MAP = {"AutoConfig": "modeling_hybrid.HybridJaxConfig",
            "AutoModelForCausalLM": "modeling_hybrid.HybridJaxForCausalLM"}


def hf_name(path: str) -> tuple[str, str]:
    """Our dotted path -> ``(HF name, layout)``; layout ``linear`` (transpose), ``conv`` or ``same``."""
    if path == "embed.embedding":
        return "model.embed_tokens.weight", "same"
    if path == "final_norm.weight":
        return "model.norm.weight", "same"
    if path.endswith("conv1d.kernel"):
        return "model." + path.removesuffix("kernel") + "weight", "conv"
    if path.endswith(".kernel"):
        return "model." + path.removesuffix("kernel") + "weight", "linear"
    return "model." + path, "same"


def to_hf(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our flat parameters -> the HF state dict of ``HybridJaxForCausalLM`` (numpy, PyTorch layouts)."""
    out = {}
    for path, value in params.items():
        name, layout = hf_name(path)
        value = {"linear": lambda a: a.T, "conv": lambda a: a.T[:, None, :], "same": lambda a: a}[layout](value)
        out[name] = np.ascontiguousarray(value)
    return out


NO_POSITION_LIMIT = 1 << 20  # max_position_embeddings of a model whose layers compute any position


def position_limit(model_cfg: ConfigDict) -> int:
    """The longest sequence the exported model is built for, written as ``max_position_embeddings``.

    The recurrent mixers have no limit, and the modeling file computes RoPE angles for any position, so a model
    without MLA layers or with plain RoPE gets :data:`NO_POSITION_LIMIT`; with YaRN (``mla.rope_scaling_factor`` >
    1) it is the context YaRN extends to, ``original_max_position_embeddings x rope_scaling_factor``.
    """
    mla = model_cfg.mla
    if "mla" not in sublayer_kinds(model_cfg) or mla.rope_scaling_factor <= 1.0:
        return NO_POSITION_LIMIT
    return int(mla.original_max_position_embeddings * mla.rope_scaling_factor)


def hf_config(config: ConfigDict, *, torch_dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """``config.json`` of the export: the ``HybridJaxConfig`` fields, ``auto_map`` and the source run's config."""
    m = config.model
    return dict(
        model_type="hybrid_jax", architectures=["HybridJaxForCausalLM"], auto_map=AUTO_MAP,
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, layer_kinds=sublayer_kinds(m), ffn_size=m.ffn_size,
        norm_eps=m.norm_eps, gdn=m.gdn.to_dict(), kda=m.kda.to_dict(), mamba2=m.mamba2.to_dict(), mla=m.mla.to_dict(),
        tie_word_embeddings=True, torch_dtype=torch_dtype, bos_token_id=bos_id, eos_token_id=eos_id,
        max_position_embeddings=position_limit(m), use_cache=False,
    )


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the modeling file's state dict for ``cfg`` (built on the meta device; tied head left out)."""
    import torch

    from hybrid_jax.export.modeling_hybrid import HybridJaxConfig, HybridJaxForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")}
    with torch.device("meta"):
        model = HybridJaxForCausalLM(HybridJaxConfig(**fields))
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}


def write_modeling_file(out: Path) -> None:
    shutil.copyfile(MODELING_FILE, out / MODELING_FILE.name)


def write_config(cfg: dict, out: Path) -> None:
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
