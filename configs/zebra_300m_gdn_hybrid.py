"""300M GDN + MLA hybrid (Primus zebra_llama_300M_gdn_hybrid): 3 MLA + 9 GDN + 12 MLP."""

from hybrid_jax.config import base_config, recipe_300m


def get_config():
    c = recipe_300m(base_config())
    c.model.update(
        dict(name="zebra_300m_gdn_hybrid", hidden_size=1024, num_layers=24, mixer="gdn", ffn_size=4096,
             pattern="*-M-M-M-*-M-M-M-*-M-M-M-")
    )
    c.train.zero1 = True
    return c
