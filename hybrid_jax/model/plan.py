"""The layer plan: which sublayer sits where, in Primus's alphabet.

A plan is a string with one character per sublayer (Megatron counts every mixer and every MLP as one
layer, each its own pre-norm residual block):

* ``*``  Multi-head Latent Attention (MLA)
* ``M``  the model's recurrent mixer (``model.mixer``: ``gdn``, ``kda`` or ``mamba2``)
* ``-``  SwiGLU MLP
* ``G``, ``K``, ``S``  an explicit Gated DeltaNet, KDA or Mamba2 (SSD) mixer, for mixed stacks such as the demo

With no explicit ``model.pattern`` the plan follows Primus's ``allocate_layers`` rule from
``num_layers`` and ``hybrid_attention_ratio`` (attention first in each block, one MLP after every mixer).
"""

from __future__ import annotations

from ml_collections import ConfigDict

MLA, MIXER, MLP = "*", "M", "-"
EXPLICIT_MIXERS = {"G": "gdn", "K": "kda", "S": "mamba2"}
MIXERS = ("gdn", "kda", "mamba2")
# model.remat -> the sublayer kinds that recompute their forward in the backward (what they keep: REMAT_POLICIES in
# hybrid_jax.model.stack; only their input where it names none)
REMAT_KINDS = {"none": (), "mixer": ("mla", *MIXERS), "full": ("mla", *MIXERS, "mlp"), "dots": ("mla", *MIXERS, "mlp")}
REMAT_MODES = tuple(REMAT_KINDS)
ALPHABET = MLA + MIXER + MLP + "".join(EXPLICIT_MIXERS)


def recomputed(kind: str, cfg: ConfigDict) -> bool:
    """Whether a sublayer of ``kind`` recomputes its forward in the backward under the model config's ``remat``."""
    return kind in REMAT_KINDS[cfg.get("remat", "none")]


def allocate_layers(num_layers: int, attention_ratio: float) -> str:
    """Primus's rule: ``num_layers // 2`` mixers, ``int(n_mix * ratio)`` of them MLA, each followed by an MLP."""
    if num_layers <= 0 or num_layers % 2:
        raise ValueError(f"num_layers must be a positive even number of sublayers, got {num_layers}")
    if not 0.0 <= attention_ratio <= 1.0:
        raise ValueError(f"hybrid_attention_ratio must be in [0, 1], got {attention_ratio}")
    n_mix = num_layers // 2
    n_attn = int(n_mix * attention_ratio)
    n_rec = n_mix - n_attn
    if n_attn == 0:
        return "M-" * n_mix
    if attention_ratio <= 0.5:
        per = n_rec // n_attn
        return ("*-" + "M-" * per) * n_attn + "M-" * (n_rec % n_attn)
    return "*-" * (n_attn - n_rec) + "*-M-" * n_rec


def validate_pattern(pattern: str) -> str:
    """Return ``pattern`` if every character is a known sublayer, else raise a ValueError naming the first bad one."""
    if not pattern:
        raise ValueError("layer pattern is empty")
    for pos, ch in enumerate(pattern):
        if ch not in ALPHABET:
            raise ValueError(
                f"layer pattern {pattern!r}: bad character {ch!r} at position {pos}; "
                f"use '*' (MLA), 'M' (the model's mixer), '-' (MLP) or G/K/S (GDN/KDA/Mamba2)"
            )
    return pattern


def layer_plan(model_cfg: ConfigDict) -> str:
    """The sublayer pattern of a model config (``model.pattern`` if set, else Primus's ratio rule)."""
    if model_cfg.pattern:
        return validate_pattern(model_cfg.pattern)
    return allocate_layers(model_cfg.num_layers, model_cfg.hybrid_attention_ratio)


def sublayer_kinds(model_cfg: ConfigDict) -> list[str]:
    """The plan resolved to sublayer kinds: ``"mla"``, ``"mlp"``, ``"gdn"``, ``"kda"`` or ``"mamba2"``."""
    if model_cfg.mixer not in MIXERS:
        raise ValueError(f"model.mixer must be one of {MIXERS}, got {model_cfg.mixer!r}")
    names = {MLA: "mla", MLP: "mlp", MIXER: model_cfg.mixer, **EXPLICIT_MIXERS}
    return [names[ch] for ch in layer_plan(model_cfg)]


def plan_fields(kinds: list[str], model_cfg: ConfigDict) -> dict:
    """The plan keys (``pattern``, ``num_layers``, ``hybrid_attention_ratio``, ``mixer``) to set in ``model_cfg`` so
    that its :func:`sublayer_kinds` are ``kinds``, changing as few as it can: none when its plan already is, else
    ``model.mixer``, else Primus's ratio rule (its ratio, then ``attention / mixers`` to 4 decimals), else an explicit
    pattern."""
    mixers = sorted(set(kinds) - {"mla", "mlp"})
    mixer = mixers[0] if len(mixers) == 1 else model_cfg.mixer
    letters = {"mla": MLA, "mlp": MLP, **{v: k for k, v in EXPLICIT_MIXERS.items()}} | (
        {mixer: MIXER} if len(mixers) == 1 else {})
    n_mix = max(len(kinds) // 2, 1)
    candidates = [{}, {"mixer": mixer}] + [
        dict(pattern="", num_layers=len(kinds), hybrid_attention_ratio=ratio, mixer=mixer)
        for ratio in (model_cfg.hybrid_attention_ratio, round(kinds.count("mla") / n_mix, 4))]
    for fields in candidates:
        try:
            if sublayer_kinds(ConfigDict(model_cfg.to_dict() | fields)) == kinds:
                return fields
        except ValueError:  # an odd number of sublayers: no ratio-rule plan
            continue
    return dict(pattern="".join(letters[k] for k in kinds), num_layers=len(kinds), mixer=mixer)
