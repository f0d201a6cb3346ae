"""1B pure KDA (Primus zebra_llama_1B_kda_pure): 16 KDA + 16 MLP, 16 heads, key dim 32, value dim 64."""

from hybrid_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(dict(name="zebra_1b_kda", hidden_size=2048, num_layers=32, mixer="kda", ffn_size=8192))
    c.model.kda.update(dict(num_key_heads=16, num_value_heads=16, key_head_dim=32, value_head_dim=64))
    # Primus's 10B-token variant (FLA reference: 4 GPUs x 16): 76294 steps x 64 x 2048.
    c.train.update(dict(steps=76294, global_batch_size=64, micro_batch_size=16, zero1=True))
    return c
