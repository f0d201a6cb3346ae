"""HF format for every model (hybrids included): the self-contained ``modeling_hybrid.py`` and its state dict, both
ways.

Names mirror ours: ``embed.embedding -> model.embed_tokens.weight``, ``final_norm.weight -> model.norm.weight``,
``layers.{i}.X -> model.layers.{i}.X`` with ``kernel -> weight`` (Linear: transposed to ``[out, in]``; conv
``[K, C] -> [C, 1, K]``), ``lm_head -> lm_head.weight``. A tied output layer (``tie_word_embeddings``, our
``model.tie_embeddings``) is not stored. :func:`hf_name` is the one table; :func:`from_hf` and
:func:`model_config_from_hf` read an export back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.export.fla import ARCHITECTURES
from hybrid_jax.export.tensors import ExportError, from_torch, to_torch
from hybrid_jax.model.plan import MIXERS, plan_fields, sublayer_kinds

MODELING_FILE = Path(__file__).with_name("modeling_hybrid.py")
AUTO_MAP = {"AutoConfig": "modeling_hybrid.HybridJaxConfig",
            "AutoModelForCausalLM": "modeling_hybrid.HybridJaxForCausalLM"}


def hf_name(path: str) -> tuple[str, str]:
    """Our dotted path -> ``(HF name, layout)``; layout ``linear`` (transpose), ``conv`` or ``same``."""
    if path == "embed.embedding":
        return "model.embed_tokens.weight", "same"
    if path == "final_norm.weight":
        return "model.norm.weight", "same"
    if path == "lm_head":
        return "lm_head.weight", "same"
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
        out[name] = np.ascontiguousarray(to_torch(value, layout))
    return out


def from_hf(tensors: dict[str, np.ndarray], paths: list[str]) -> dict[str, np.ndarray]:
    """The state dict of one of our HF exports -> our flat parameters ``paths`` (the model's, e.g. from
    ``param_shapes``): the inverse of :func:`to_hf`. A tensor too many or missing is an :class:`ExportError`."""
    names = {path: hf_name(path) for path in paths}
    extra = sorted(set(tensors) - {name for name, _ in names.values()})
    if extra:
        raise ExportError(f"HF import: unexpected tensor {extra[0]!r} (the config.json describes no such parameter)")
    missing = [name for name, _ in names.values() if name not in tensors]
    if missing:
        raise ExportError(f"HF import: missing tensor {missing[0]!r}")
    return {path: from_torch(tensors[name], layout) for path, (name, layout) in names.items()}


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
        tie_word_embeddings=m.tie_embeddings, torch_dtype=torch_dtype, bos_token_id=bos_id, eos_token_id=eos_id,
        max_position_embeddings=position_limit(m), use_cache=False,
    )


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the modeling file's state dict for ``cfg`` (built on the meta device; a tied head left
    out)."""
    import torch

    from hybrid_jax.export.modeling_hybrid import HybridJaxConfig, HybridJaxForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")}
    with torch.device("meta"):
        model = HybridJaxForCausalLM(HybridJaxConfig(**fields))
    tied = cfg.get("tie_word_embeddings", True)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def read_export_config(directory: Path) -> dict:
    """``config.json`` of one of our HF exports (``model_type`` ``hybrid_jax``); any other directory is an
    :class:`ExportError` of one line saying what to pass instead. Reads nothing else."""
    what = "--from-hf reads a directory written by `python -m hybrid_jax.export --format hf`"
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ExportError(f"{directory} has no config.json: {what}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path} is not JSON ({e}): {what}") from None
    model_type = cfg.get("model_type")
    if model_type == "hybrid_jax":
        return cfg
    if model_type in {arch for arch, _ in ARCHITECTURES.values()}:
        raise ExportError(f"{directory} is an FLA checkpoint (model_type {model_type!r}): import it with --from-fla")
    raise ExportError(f"{directory} is not a hybrid_jax HF export (model_type {model_type!r}): {what}")


def model_config_from_hf(hf_cfg: dict, base: ConfigDict) -> ConfigDict:
    """Our config for the ``config.json`` of one of our HF exports: ``base`` with the model keys the export records
    (sizes, the plan via :func:`plan_fields`, the sub-configs of the sublayer kinds it uses, the output layer's
    tying); every other key is ``base``'s."""
    cfg = ConfigDict(base.to_dict())
    m, kinds = cfg.model, list(hf_cfg["layer_kinds"])
    unknown = sorted(set(kinds) - {"mla", "mlp", *MIXERS})
    if unknown:
        raise ExportError(f"HF config: layer kind {unknown[0]!r} is not one of ours")
    m.update(dict(vocab_size=hf_cfg["vocab_size"], hidden_size=hf_cfg["hidden_size"], ffn_size=hf_cfg["ffn_size"],
                  norm_eps=hf_cfg["norm_eps"], tie_embeddings=bool(hf_cfg.get("tie_word_embeddings", True))))
    m.update(plan_fields(kinds, m))
    for kind in sorted(set(kinds) - {"mlp"}):
        unknown = sorted(set(hf_cfg[kind]) - set(m[kind]))
        if unknown:
            raise ExportError(f"HF config: {kind}.{unknown[0]} is not a key of our model.{kind}")
        m[kind].update(hf_cfg[kind])
    return cfg


def write_modeling_file(out: Path) -> None:
    shutil.copyfile(MODELING_FILE, out / MODELING_FILE.name)


def write_config(cfg: dict, out: Path) -> None:
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
