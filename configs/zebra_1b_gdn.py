"""1B pure GDN (Primus zebra_llama_1B_gdn_pure, 100B-token recipe): 16 GDN + 16 MLP, hidden 2048."""

from hybrid_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(dict(name="zebra_1b_gdn", hidden_size=2048, num_layers=32, mixer="gdn", ffn_size=8192))
    c.model.gdn.update(dict(num_key_heads=8, num_value_heads=16, key_head_dim=64, value_head_dim=64))
    # 100B tokens: 95368 steps x 512 x 2048.
    c.train.update(dict(steps=95368, global_batch_size=512, micro_batch_size=16, lr=3e-4, min_lr=3e-5,
                        warmup_steps=2000, zero1=True))
    return c
