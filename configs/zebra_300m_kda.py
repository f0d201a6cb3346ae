"""300M pure KDA (Primus zebra_llama_300M_kda_pure): 12 KDA + 12 MLP, 8 heads, key dim 32, value dim 64."""

from hybrid_jax.config import base_config, recipe_300m


def get_config():
    c = recipe_300m(base_config())
    c.model.update(dict(name="zebra_300m_kda", hidden_size=1024, num_layers=24, mixer="kda", ffn_size=4096))
    c.model.kda.update(dict(num_key_heads=8, num_value_heads=8, key_head_dim=32, value_head_dim=64))
    return c
