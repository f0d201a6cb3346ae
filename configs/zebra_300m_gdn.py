"""300M pure Gated DeltaNet (Primus zebra_llama_300M_gdn_pure): 12 GDN + 12 MLP, hidden 1024. 307.8M params."""

from hybrid_jax.config import base_config, recipe_300m


def get_config():
    c = recipe_300m(base_config())
    c.model.update(dict(name="zebra_300m_gdn", hidden_size=1024, num_layers=24, mixer="gdn", ffn_size=4096))
    c.model.gdn.update(dict(num_key_heads=4, num_value_heads=8, key_head_dim=64, value_head_dim=64))
    return c
