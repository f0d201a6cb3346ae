"""300M Mamba2 + MLA hybrid (Primus zebra_llama_300M_mamba_hybrid): 3 MLA + 9 Mamba2 (expand 2) + 12 MLP."""

from hybrid_jax.config import base_config, recipe_300m


def get_config():
    c = recipe_300m(base_config())
    c.model.update(
        dict(name="zebra_300m_mamba2_hybrid", hidden_size=1024, num_layers=24, mixer="mamba2", ffn_size=4096,
             pattern="*-M-M-M-*-M-M-M-*-M-M-M-")
    )
    c.model.mamba2.update(dict(state_dim=64, head_dim=64, num_groups=8, expand=2))
    c.train.zero1 = True
    return c
