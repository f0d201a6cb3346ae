"""1B KDA + MLA hybrid at seq 8192 (Primus zebra_kda_1B_hybrid, run by zebra_llama_1B_kda-pretrain): the 1B Mamba2 +
MLA layout (*-M-M-M- x 4, MLA as in zebra_1b_mamba2_hybrid) with KDA in the M slots.

Primus's model file sets no KDA dims, so its KDA layers take Megatron's defaults: 16 key heads x 128, 32 value heads
x 128, conv 4 (reference/primus.md 3.4 marks this as inferred); the low-rank gates' rank is the value head dim, 128.
Its recipe: lr 2e-4 -> 2e-5, warmup 200, cosine over 38147 steps, seq 8192, ZeRO-1; micro batch 8 / global 64 as
its refactored MI300X run. Weight decay stays the project's 0.01 (Primus 0.1: override with
--config.train.weight_decay=0.1); norms are RMSNorm with Primus's eps 1e-5.
"""

from hybrid_jax.config import mamba_mla_config


def get_config():
    c = mamba_mla_config()
    c.model.update(dict(name="zebra_1b_kda_hybrid", hidden_size=2048, num_layers=32, ffn_size=8192, mixer="kda",
                        norm_eps=1e-5))
    c.model.kda.update(dict(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128))
    c.model.mla.update(dict(num_heads=32, q_lora_rank=1344, kv_lora_rank=128, qk_nope_head_dim=32,
                            qk_rope_head_dim=32, v_head_dim=64))
    c.train.update(dict(steps=38147, global_batch_size=64, micro_batch_size=8))
    return c
