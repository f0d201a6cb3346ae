"""3B Mamba2 + MLA (Primus zebra_llama_3B): 7 MLA + 21 Mamba2 + 28 MLP, hidden 3072.

``model.remat=dots`` (keep the projections' outputs, recompute the rest): micro batch 4 x 8192 fits one GPU of 141 GB
(95.6 GiB peak on an H200, MFU 50%; ``benchmarks/RESULTS.md``)."""

from hybrid_jax.config import mamba_mla_config


def get_config():
    c = mamba_mla_config()
    c.model.update(dict(name="zebra_3b", hidden_size=3072, num_layers=56, ffn_size=8192, remat="dots"))
    c.model.mamba2.update(dict(state_dim=128, head_dim=128))
    c.model.mla.update(dict(num_heads=24, q_lora_rank=1536, kv_lora_rank=128, qk_nope_head_dim=64,
                            qk_rope_head_dim=64, v_head_dim=128))
    c.train.update(dict(global_batch_size=32, micro_batch_size=4))
    return c
