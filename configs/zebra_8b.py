"""8B Mamba2 + MLA (Primus zebra_llama_8B): 8 MLA + 24 Mamba2 + 32 MLP, hidden 4096.

The ffn size 14436 is Primus's number as published (Llama-3.1-8B uses 14336).
"""

from hybrid_jax.config import mamba_mla_config


def get_config():
    c = mamba_mla_config()
    c.model.update(dict(name="zebra_8b", hidden_size=4096, num_layers=64, ffn_size=14436))
    c.model.mamba2.update(dict(state_dim=128, head_dim=128))
    c.model.mla.update(dict(num_heads=32, q_lora_rank=2048, kv_lora_rank=160, qk_nope_head_dim=64,
                            qk_rope_head_dim=64, v_head_dim=128))
    c.train.update(dict(global_batch_size=16, micro_batch_size=2))
    return c
