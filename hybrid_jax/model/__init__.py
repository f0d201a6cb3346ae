"""hybrid_jax.model: Flax NNX modules of the hybrid recurrent-attention LM.

``HybridLM(config.model, rngs=nnx.Rngs(seed))`` builds the model of a layer plan (``layer_plan``);
``count_params(config.model)`` counts its parameters without allocating them; ``param_names(model)`` maps each
parameter path to its Primus/Megatron and FLA/HF names (see ``hybrid_jax.model.params``).
"""

from hybrid_jax.model.params import PARAM_NAMES, ParamName, count_params, param_names, param_shapes
from hybrid_jax.model.plan import layer_plan, sublayer_kinds
from hybrid_jax.model.stack import HybridLM, Sublayer, tied_logits

__all__ = [
    "PARAM_NAMES",
    "HybridLM",
    "ParamName",
    "Sublayer",
    "count_params",
    "layer_plan",
    "param_names",
    "param_shapes",
    "sublayer_kinds",
    "tied_logits",
]
