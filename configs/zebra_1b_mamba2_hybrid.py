"""1B Mamba2 + MLA (Primus zebra_llama_1B): *-M-M-M- x 4, hidden 2048, Mamba2 expand 1 (32 heads)."""

from hybrid_jax.config import mamba_mla_config


def get_config():
    c = mamba_mla_config()
    c.model.update(dict(name="zebra_1b_mamba2_hybrid", hidden_size=2048, num_layers=32, ffn_size=8192))
    c.model.mamba2.update(dict(state_dim=64, head_dim=64))
    c.model.mla.update(dict(num_heads=32, q_lora_rank=1344, kv_lora_rank=128, qk_nope_head_dim=32,
                            qk_rope_head_dim=32, v_head_dim=64))
    c.train.update(dict(global_batch_size=64, micro_batch_size=8))
    return c
