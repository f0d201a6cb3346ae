"""FLA format for pure GDN and pure KDA models, both directions (``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM``).

FLA layer ``j`` holds our sublayers ``2j`` (the mixer, ``attn``) and ``2j + 1`` (the MLP), so only plans of the form
``M-M-...`` with one mixer kind map onto it. One rule table drives both directions: each rule names one of our
parameters, its FLA piece(s) (fused tensors are split along the PyTorch output axis) and a layout (``linear``,
``conv`` or ``same``: ``hybrid_jax.export.tensors``).

The output layer follows ``model.tie_embeddings`` <-> FLA's ``tie_word_embeddings`` (FLA's own default is False):
a tied model's ``lm_head.weight`` is written as a copy of the embedding, an untied one's is our ``lm_head``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.export.tensors import ExportError, from_torch, to_torch
from hybrid_jax.model.plan import layer_plan, plan_fields, sublayer_kinds

ARCHITECTURES = {"gdn": ("gated_deltanet", "GatedDeltaNetForCausalLM"), "kda": ("kda", "KDAForCausalLM")}
FLA_PREFIX = "model.layers.{j}."


class Rule(NamedTuple):
    ours: str  # our path, relative to the sublayer (``norm.weight``, ``mixer.in_proj.kernel``, ...)
    pieces: tuple[tuple[str, int], ...]  # FLA names (relative to FLA layer j) and their sizes on the output axis
    layout: str  # linear | conv | same


def _mixer_rules(kind: str, m: ConfigDict) -> list[Rule]:
    c = m[kind]
    qk, vd, hv, dv = c.num_key_heads * c.key_head_dim, c.num_value_heads * c.value_head_dim, c.num_value_heads, \
        c.value_head_dim
    conv = Rule("mixer.conv1d.kernel", (("attn.q_conv1d.weight", qk), ("attn.k_conv1d.weight", qk),
                                        ("attn.v_conv1d.weight", vd)), "conv")
    common = [Rule("norm.weight", (("attn_norm.weight", 0),), "same"), conv,
              Rule("mixer.A_log", (("attn.A_log", 0),), "same"),
              Rule("mixer.dt_bias", (("attn.dt_bias", 0),), "same"),
              Rule("mixer.out_norm.weight", (("attn.o_norm.weight", 0),), "same"),
              Rule("mixer.out_proj.kernel", (("attn.o_proj.weight", 0),), "linear")]
    if kind == "gdn":
        in_proj = (("attn.q_proj.weight", qk), ("attn.k_proj.weight", qk), ("attn.v_proj.weight", vd),
                   ("attn.g_proj.weight", vd), ("attn.b_proj.weight", hv), ("attn.a_proj.weight", hv))
        return [Rule("mixer.in_proj.kernel", in_proj, "linear"), *common]
    in_proj = (("attn.q_proj.weight", qk), ("attn.k_proj.weight", qk), ("attn.v_proj.weight", vd),
               ("attn.f_proj.0.weight", dv), ("attn.g_proj.0.weight", dv), ("attn.b_proj.weight", hv))
    return [Rule("mixer.in_proj.kernel", in_proj, "linear"), *common,
            Rule("mixer.f_b_proj.kernel", (("attn.f_proj.1.weight", 0),), "linear"),
            Rule("mixer.g_b_proj.kernel", (("attn.g_proj.1.weight", 0),), "linear"),
            Rule("mixer.g_b_proj.bias", (("attn.g_proj.1.bias", 0),), "same")]


def _mlp_rules(m: ConfigDict) -> list[Rule]:
    return [Rule("norm.weight", (("mlp_norm.weight", 0),), "same"),
            Rule("mlp.linear_fc1.kernel", (("mlp.gate_proj.weight", m.ffn_size), ("mlp.up_proj.weight", m.ffn_size)),
                 "linear"),
            Rule("mlp.linear_fc2.kernel", (("mlp.down_proj.weight", 0),), "linear")]


def fla_kind(model_cfg: ConfigDict) -> str:
    """``"gdn"`` or ``"kda"`` if the model maps onto an FLA model, else an :class:`ExportError` saying why."""
    kinds = sublayer_kinds(model_cfg)
    mixers = set(kinds[0::2])
    if len(mixers) != 1 or not mixers <= set(ARCHITECTURES) or set(kinds[1::2]) != {"mlp"} or len(kinds) % 2:
        raise ExportError(
            f"--format fla needs a pure GDN or pure KDA model (plan 'M-M-...' with mixer gdn or kda); this model's "
            f"plan is {layer_plan(model_cfg)!r} with sublayers {kinds}. Export hybrids with --format hf")
    kind = mixers.pop()
    c = model_cfg[kind]
    if kind == "kda" and c.num_value_heads != c.num_key_heads:
        raise ExportError("--format fla: FLA's KDA has one gate per key head; num_value_heads "
                          f"{c.num_value_heads} != num_key_heads {c.num_key_heads} cannot be expressed")
    return kind


def _rules(model_cfg: ConfigDict) -> list[tuple[str, str, Rule]]:
    """``(our path, FLA name prefix, rule)`` for every parameter, model-level entries included."""
    kind = fla_kind(model_cfg)
    out = [("embed.embedding", "", Rule("", (("model.embeddings.weight", 0),), "same")),
           ("final_norm.weight", "", Rule("", (("model.norm.weight", 0),), "same"))]
    if not model_cfg.tie_embeddings:
        out.append(("lm_head", "", Rule("", (("lm_head.weight", 0),), "same")))
    for j in range(len(sublayer_kinds(model_cfg)) // 2):
        prefix = FLA_PREFIX.format(j=j)
        out += [(f"layers.{2 * j}.{r.ours}", prefix, r) for r in _mixer_rules(kind, model_cfg)]
        out += [(f"layers.{2 * j + 1}.{r.ours}", prefix, r) for r in _mlp_rules(model_cfg)]
    return out


def to_fla(params: dict[str, np.ndarray], model_cfg: ConfigDict) -> dict[str, np.ndarray]:
    """Our flat parameters -> FLA state dict (numpy, PyTorch layouts); ``lm_head.weight`` is our ``lm_head``, or a
    copy of the embedding when tied."""
    out = {}
    for ours, prefix, rule in _rules(model_cfg):
        if ours not in params:
            raise ExportError(f"--format fla: our parameter {ours!r} is missing")
        value = to_torch(params[ours], rule.layout)
        sizes = [s for _, s in rule.pieces]
        if len(sizes) > 1 and sum(sizes) != value.shape[0]:
            raise ExportError(f"--format fla: {ours!r} has {value.shape[0]} output rows, the split "
                              f"{[n for n, _ in rule.pieces]} needs {sum(sizes)}")
        parts = np.split(value, np.cumsum(sizes)[:-1], axis=0) if len(sizes) > 1 else [value]
        out.update({prefix + name: np.ascontiguousarray(p) for (name, _), p in zip(rule.pieces, parts, strict=True)})
    if model_cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embeddings.weight"].copy()
    return out


def from_fla(tensors: dict[str, np.ndarray], model_cfg: ConfigDict) -> dict[str, np.ndarray]:
    """FLA state dict -> our flat parameters (inverse of :func:`to_fla`). A missing FLA key is an ExportError; so is
    an ``lm_head.weight`` that differs from the embedding of a model whose config ties them."""
    out = {}
    for ours, prefix, rule in _rules(model_cfg):
        missing = [prefix + n for n, _ in rule.pieces if prefix + n not in tensors]
        if missing:
            raise ExportError(f"FLA checkpoint: missing tensor {missing[0]!r} (for our {ours!r})")
        out[ours] = from_torch(np.concatenate([tensors[prefix + n] for n, _ in rule.pieces], axis=0), rule.layout)
    head = tensors.get("lm_head.weight")
    if model_cfg.tie_embeddings and head is not None and not np.array_equal(head, tensors["model.embeddings.weight"]):
        raise ExportError("FLA checkpoint: 'lm_head.weight' differs from 'model.embeddings.weight' although its "
                          "config.json says tie_word_embeddings=true")
    known = {prefix + n for _, prefix, rule in _rules(model_cfg) for n, _ in rule.pieces} | {"lm_head.weight"}
    extra = sorted(set(tensors) - known)
    if extra:
        raise ExportError(f"FLA checkpoint: unexpected tensor {extra[0]!r} (a conv bias, an attention layer or "
                          "another option our model does not have)")
    return out


def fla_config(model_cfg: ConfigDict, *, max_position_embeddings: int = 2048) -> dict:
    """The FLA ``config.json`` of a pure GDN/KDA model (its embedding tying, unfused kernels for portability)."""
    kind = fla_kind(model_cfg)
    c = model_cfg[kind]
    model_type, arch = ARCHITECTURES[kind]
    cfg = dict(model_type=model_type, architectures=[arch], attn_mode="chunk", hidden_size=model_cfg.hidden_size,
               num_heads=c.num_key_heads, num_v_heads=c.num_value_heads, head_dim=c.key_head_dim,
               expand_v=c.value_head_dim / c.key_head_dim, use_short_conv=True, conv_size=c.conv_size,
               allow_neg_eigval=False, num_hidden_layers=len(sublayer_kinds(model_cfg)) // 2,
               intermediate_size=model_cfg.ffn_size, hidden_ratio=4, hidden_act="swish", norm_eps=model_cfg.norm_eps,
               vocab_size=model_cfg.vocab_size, tie_word_embeddings=model_cfg.tie_embeddings,
               initializer_range=model_cfg.init_std,
               max_position_embeddings=max_position_embeddings, fuse_norm=False, fuse_swiglu=False,
               fuse_cross_entropy=False, fuse_linear_cross_entropy=False, use_cache=True)
    if kind == "gdn":
        cfg["use_gate"] = True
    return cfg


def model_config_from_fla(fla_cfg: dict, base: ConfigDict) -> ConfigDict:
    """Our model config for an FLA ``config.json`` (``base``: the config whose other fields are kept)."""
    kinds = {v[0]: k for k, v in ARCHITECTURES.items()}
    if fla_cfg.get("model_type") == "hybrid_jax":
        raise ExportError("FLA config: model_type 'hybrid_jax' is our own HF export: import it with --from-hf")
    if fla_cfg.get("model_type") not in kinds:
        raise ExportError(f"FLA config: model_type {fla_cfg.get('model_type')!r} is not one of {sorted(kinds)}")
    kind = kinds[fla_cfg["model_type"]]
    for key, want in (("attn", None), ("use_short_conv", True), ("allow_neg_eigval", False), ("conv_bias", False),
                      ("use_gate", True if kind == "gdn" else None)):
        if fla_cfg.get(key, want) != want:
            raise ExportError(f"FLA config: {key}={fla_cfg[key]!r} is not supported (our model needs {want!r})")
    head_dim, num_heads = fla_cfg["head_dim"], fla_cfg["num_heads"]
    value_dim = int(round(head_dim * fla_cfg["expand_v"]))
    hidden = fla_cfg["hidden_size"]
    ffn = fla_cfg.get("intermediate_size") or 256 * -(-int(hidden * fla_cfg.get("hidden_ratio", 4) * 2 / 3) // 256)
    cfg = ConfigDict(base.to_dict())
    m = cfg.model
    m.update(dict(vocab_size=fla_cfg["vocab_size"], hidden_size=hidden, ffn_size=ffn, norm_eps=fla_cfg["norm_eps"],
                  init_std=fla_cfg.get("initializer_range", m.init_std),
                  tie_embeddings=bool(fla_cfg.get("tie_word_embeddings", False))))  # FLA's configs: False
    m.update(plan_fields([kind, "mlp"] * fla_cfg["num_hidden_layers"], m))
    m[kind].update(dict(num_key_heads=num_heads, num_value_heads=fla_cfg.get("num_v_heads") or num_heads,
                        key_head_dim=head_dim, value_head_dim=value_dim, conv_size=fla_cfg.get("conv_size", 4)))
    return cfg


def fla_shapes(fla_cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of FLA's model for ``fla_cfg``, from FLA's layer definitions (an independent check
    of :func:`to_fla`; ``lm_head`` included, tied or not)."""
    D, vocab, inter, cs = fla_cfg["hidden_size"], fla_cfg["vocab_size"], fla_cfg["intermediate_size"], \
        fla_cfg["conv_size"]
    H, K = fla_cfg["num_heads"], fla_cfg["head_dim"]
    HV, V = fla_cfg.get("num_v_heads") or H, int(round(K * fla_cfg["expand_v"]))
    layer = {"attn_norm.weight": (D,), "attn.q_proj.weight": (H * K, D), "attn.k_proj.weight": (H * K, D),
             "attn.v_proj.weight": (HV * V, D), "attn.q_conv1d.weight": (H * K, 1, cs),
             "attn.k_conv1d.weight": (H * K, 1, cs), "attn.v_conv1d.weight": (HV * V, 1, cs),
             "attn.o_norm.weight": (V,), "attn.o_proj.weight": (D, HV * V), "mlp_norm.weight": (D,),
             "mlp.gate_proj.weight": (inter, D), "mlp.up_proj.weight": (inter, D), "mlp.down_proj.weight": (D, inter)}
    if fla_cfg["model_type"] == "gated_deltanet":
        layer.update({"attn.a_proj.weight": (HV, D), "attn.b_proj.weight": (HV, D), "attn.A_log": (HV,),
                      "attn.dt_bias": (HV,), "attn.g_proj.weight": (HV * V, D)})
    else:
        layer.update({"attn.f_proj.0.weight": (V, D), "attn.f_proj.1.weight": (H * K, V), "attn.b_proj.weight": (H, D),
                      "attn.A_log": (H,), "attn.dt_bias": (H * K,), "attn.g_proj.0.weight": (V, D),
                      "attn.g_proj.1.weight": (HV * V, V), "attn.g_proj.1.bias": (HV * V,)})
    shapes = {"model.embeddings.weight": (vocab, D), "model.norm.weight": (D,), "lm_head.weight": (vocab, D)}
    for j in range(fla_cfg["num_hidden_layers"]):
        shapes.update({FLA_PREFIX.format(j=j) + k: v for k, v in layer.items()})
    return shapes
