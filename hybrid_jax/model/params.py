"""Parameter counting and the parameter-name table (our NNX paths -> Primus/Megatron and FLA/HF names).

Our paths are the NNX state paths joined with dots. ``{i}`` is our sublayer index (= Megatron's
``decoder.layers.{i}``: every mixer and every MLP is its own layer); FLA models pair them, so FLA layer
``{j} = {i} // 2`` holds the mixer (``attn``) of sublayer ``2j`` and the MLP of sublayer ``2j + 1``.

Layout conversions (the ``note`` column):

* ``T``: our Linear ``kernel`` is ``[in, out]``; PyTorch's ``weight`` is ``[out, in]`` (transpose).
* ``conv``: our ``conv1d.kernel`` is ``[K, C]``; PyTorch's depthwise ``conv1d.weight`` is ``[C, 1, K]``.
* ``split``: one fused tensor here, several in FLA; the split points are along the output axis, in the order given.
* ``rope``: Megatron stores rope channels in an ``[even | odd]``-permuted order (its MLA applies the reorder before
  rotate-half); ours (= FLA's) are Megatron's permuted with ``cat(w[0::2], w[1::2])`` on each rope block.
* KDA ``A_log``: ``[Hv]`` here and in FLA; Primus stores ``[1, 1, Hv, 1]``.
* Mamba2 FLA names are mamba_ssm/FLA ``Mamba2`` (``backbone.layers.{i}.mixer.*``); Primus's no-TE Mamba layer has no
  pre-norm, so its converter writes ones for ``backbone.layers.{i}.norm.weight``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.model.stack import HybridLM


class ParamName(NamedTuple):
    """One row: our path, the Primus/Megatron name, the FLA/HF name(s) and the layout conversion."""

    ours: str
    primus: str
    fla: str
    note: str = "T"


_L = "decoder.layers.{i}."
_F = "model.layers.{j}."
_A = _L + "self_attention."
_M = "backbone.layers.{i}.mixer."

# Rows per sublayer kind ("model" rows are not inside a sublayer).
PARAM_NAMES: dict[str, tuple[ParamName, ...]] = {
    "model": (
        ParamName("embed.embedding", "embedding.word_embeddings.weight",
                  "model.embeddings.weight (= lm_head.weight when tied)", "same layout [V, D]; tied by default"),
        ParamName("final_norm.weight", "decoder.final_norm.weight", "model.norm.weight", "same"),
        ParamName("lm_head", "output_layer.weight", "lm_head.weight", "same layout [V, D]; model.tie_embeddings=False"),
    ),
    "mla": (
        ParamName("layers.{i}.norm.weight", _L + "input_layernorm.weight", _F + "attn_norm.weight", "same"),
        ParamName("layers.{i}.self_attention.linear_q_down_proj.kernel", _A + "linear_q_down_proj.weight",
                  _F + "attn.q_proj.0.weight"),
        ParamName("layers.{i}.self_attention.q_layernorm.weight", _A + "q_layernorm.weight",
                  _F + "attn.q_proj.1.weight", "same"),
        ParamName("layers.{i}.self_attention.linear_q_up_proj.kernel", _A + "linear_q_up_proj.weight",
                  _F + "attn.q_proj.2.weight", "T; rope (per head, output columns [nope | rope])"),
        ParamName("layers.{i}.self_attention.linear_kv_down_proj.kernel",
                  _A + "linear_kv_down_proj.weight", _F + "attn.kv_proj.0.weight, " + _F + "attn.k_rope.weight",
                  "T; split [kv_lora_rank | rope]; rope on the k_rope part"),
        ParamName("layers.{i}.self_attention.kv_layernorm.weight", _A + "kv_layernorm.weight",
                  _F + "attn.kv_proj.1.weight", "same"),
        ParamName("layers.{i}.self_attention.linear_kv_up_proj.kernel", _A + "linear_kv_up_proj.weight",
                  _F + "attn.kv_proj.2.weight", "T (per head output columns [k_nope | v])"),
        ParamName("layers.{i}.self_attention.linear_proj.kernel", _A + "linear_proj.weight",
                  _F + "attn.o_proj.weight"),
    ),
    "gdn": (
        ParamName("layers.{i}.norm.weight", _L + "norm.weight (TE: mixer.in_proj.layer_norm_weight)",
                  _F + "attn_norm.weight", "same"),
        ParamName("layers.{i}.mixer.in_proj.kernel", _L + "mixer.in_proj.weight",
                  ", ".join(_F + f"attn.{p}_proj.weight" for p in ("q", "k", "v", "g", "b", "a")),
                  "T; split [q Hk*dk | k Hk*dk | v Hv*dv | z Hv*dv | beta Hv | alpha Hv]"),
        ParamName("layers.{i}.mixer.conv1d.kernel", _L + "mixer.conv1d.weight",
                  ", ".join(_F + f"attn.{p}_conv1d.weight" for p in ("q", "k", "v")), "conv; split [q | k | v]"),
        ParamName("layers.{i}.mixer.A_log", _L + "mixer.A_log", _F + "attn.A_log", "same [Hv]"),
        ParamName("layers.{i}.mixer.dt_bias", _L + "mixer.dt_bias", _F + "attn.dt_bias", "same [Hv]"),
        ParamName("layers.{i}.mixer.out_norm.weight", _L + "mixer.out_norm.weight", _F + "attn.o_norm.weight", "same"),
        ParamName("layers.{i}.mixer.out_proj.kernel", _L + "mixer.out_proj.weight", _F + "attn.o_proj.weight"),
    ),
    "kda": (
        ParamName("layers.{i}.norm.weight", _L + "norm.weight (TE: mixer.in_proj.layer_norm_weight)",
                  _F + "attn_norm.weight", "same"),
        ParamName("layers.{i}.mixer.in_proj.kernel", _L + "mixer.in_proj.weight",
                  ", ".join(_F + f"attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "f_proj.0", "g_proj.0",
                                                                "b_proj")),
                  "T; split [q Hk*dk | k Hk*dk | v Hv*dv | f_a dv | g_a dv | beta Hv]"),
        ParamName("layers.{i}.mixer.conv1d.kernel", _L + "mixer.conv1d.weight",
                  ", ".join(_F + f"attn.{p}_conv1d.weight" for p in ("q", "k", "v")), "conv; split [q | k | v]"),
        ParamName("layers.{i}.mixer.f_b_proj.kernel", _L + "mixer.f_b_proj.weight", _F + "attn.f_proj.1.weight"),
        ParamName("layers.{i}.mixer.g_b_proj.kernel", _L + "mixer.g_b_proj.weight", _F + "attn.g_proj.1.weight"),
        ParamName("layers.{i}.mixer.g_b_proj.bias", _L + "mixer.g_b_proj.bias", _F + "attn.g_proj.1.bias", "same"),
        ParamName("layers.{i}.mixer.A_log", _L + "mixer.A_log", _F + "attn.A_log", "[Hv]; Primus [1, 1, Hv, 1]"),
        ParamName("layers.{i}.mixer.dt_bias", _L + "mixer.dt_bias", _F + "attn.dt_bias", "same [Hv*dk]"),
        ParamName("layers.{i}.mixer.out_norm.weight", _L + "mixer.out_norm.weight", _F + "attn.o_norm.weight", "same"),
        ParamName("layers.{i}.mixer.out_proj.kernel", _L + "mixer.out_proj.weight", _F + "attn.o_proj.weight"),
    ),
    "mamba2": (
        ParamName("layers.{i}.norm.weight", "(none in the no-TE spec; TE: " + _L + "mixer.in_proj.layer_norm_weight)",
                  "backbone.layers.{i}.norm.weight", "same"),
        ParamName("layers.{i}.mixer.in_proj.kernel", _L + "mixer.in_proj.weight", _M + "in_proj.weight",
                  "T; fused [z d_in | x d_in | B G*N | C G*N | dt nh] in both"),
        ParamName("layers.{i}.mixer.conv1d.kernel", _L + "mixer.conv1d.weight", _M + "conv1d.weight",
                  "conv"),
        ParamName("layers.{i}.mixer.conv1d.bias", _L + "mixer.conv1d.bias", _M + "conv1d.bias",
                  "same"),
        ParamName("layers.{i}.mixer.A_log", _L + "mixer.A_log", _M + "A_log", "same [nh]"),
        ParamName("layers.{i}.mixer.dt_bias", _L + "mixer.dt_bias", _M + "dt_bias", "same [nh]"),
        ParamName("layers.{i}.mixer.D", _L + "mixer.D", _M + "D", "same [nh]"),
        ParamName("layers.{i}.mixer.norm.weight", _L + "mixer.norm.weight", _M + "norm.weight",
                  "same [d_in]"),
        ParamName("layers.{i}.mixer.out_proj.kernel", _L + "mixer.out_proj.weight",
                  _M + "out_proj.weight"),
    ),
    "mlp": (
        ParamName("layers.{i}.norm.weight", _L + "pre_mlp_layernorm.weight (TE: mlp.linear_fc1.layer_norm_weight)",
                  _F + "mlp_norm.weight", "same"),
        ParamName("layers.{i}.mlp.linear_fc1.kernel", _L + "mlp.linear_fc1.weight",
                  _F + "mlp.gate_proj.weight, " + _F + "mlp.up_proj.weight", "T; split [gate F | up F]"),
        ParamName("layers.{i}.mlp.linear_fc2.kernel", _L + "mlp.linear_fc2.weight", _F + "mlp.down_proj.weight"),
    ),
}


def path_name(path: tuple) -> str:
    """An NNX state path as a dotted name: ``('layers', 3, 'mixer', 'A_log') -> 'layers.3.mixer.A_log'``."""
    return ".".join(str(p) for p in path)


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Every ``nnx.Param`` of ``model`` (concrete or abstract) as ``{dotted path: shape}``."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {path_name(path): tuple(var.shape) for path, var in flat}


def param_names(model: HybridLM) -> dict[str, ParamName]:
    """The table row of every parameter of ``model``, indices filled in: ``{dotted path: ParamName}``.

    Raises ``KeyError`` for a parameter that the table does not document.
    """
    rows = {}
    for kind, table in PARAM_NAMES.items():
        kinds = [None] if kind == "model" else [i for i, layer in enumerate(model.layers) if layer.kind == kind]
        for i in kinds:
            idx = {} if i is None else {"i": i, "j": i // 2}
            for row in table:
                rows[row.ours.format(**idx)] = ParamName(*(s.format(**idx) for s in row))
    missing = [p for p in param_shapes(model) if p not in rows]
    if missing:
        raise KeyError(f"parameters without a documented name: {missing}")
    return {p: rows[p] for p in param_shapes(model)}


def count_params(model_cfg: ConfigDict) -> int:
    """Number of parameters of ``HybridLM(model_cfg)`` (a tied embedding once; an untied ``lm_head`` is ``V x D``
    more), from shapes only: nothing is allocated."""
    abstract = nnx.eval_shape(lambda: HybridLM(model_cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
