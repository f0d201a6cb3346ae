"""1B GDN at seq 8192 (Primus zebra_gdn_1B_hybrid, run by zebra_llama_1B_gdn-pretrain): Primus names it a hybrid
(the hybrid stack, hybrid_attention_ratio 0.0) but it has no attention: 16 GDN + 16 MLP with zebra_1b_gdn's layers.

What differs from zebra_1b_gdn is the recipe: seq 8192, lr 2e-4 -> 2e-5, warmup 200, cosine over 38147 steps,
global batch 112 (Primus's MI300X maximum, 8 x 14; here micro batch 7), ZeRO-1, norm eps 1e-5 (Primus's mamba_base;
its norms are LayerNorm by inheritance, ours RMSNorm). Weight decay stays the project's 0.01 (Primus 0.1: override
with --config.train.weight_decay=0.1).
"""

from hybrid_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(dict(name="zebra_1b_gdn_hybrid", hidden_size=2048, num_layers=32, mixer="gdn", ffn_size=8192,
                        norm_eps=1e-5))
    c.model.gdn.update(dict(num_key_heads=8, num_value_heads=16, key_head_dim=64, value_head_dim=64))
    c.train.update(dict(steps=38147, global_batch_size=112, micro_batch_size=7, seq_len=8192, lr=2e-4, min_lr=2e-5,
                        warmup_steps=200, zero1=True))
    return c
