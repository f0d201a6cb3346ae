"""A tiny hybrid with every sublayer kind (MLA, GDN, KDA, Mamba2, MLP) that trains on CPU in minutes.

Mock data (a fixed random Markov chain) by default: no tokenizer, no download; add
``--config.data.validation_path=mock`` for a validation loss on held-out chain sequences.

On real data, prepare it first (``python -m hybrid_jax.prepare --input FILES --tokenizer TOKENIZER --output DIR``),
then train with ``--config.data.source=tokens --config.data.path=DIR --config.model.vocab_size=V``: the vocabulary
must cover the tokenizer's ids (V = 32000 for Llama-2, 128256 for Llama-3; the trainer refuses a smaller one and
names the number). The tokenizer is taken from DIR's manifest. ``--config.data.validation_path=FILE.jsonl`` scores
held-out documents every ``train.eval_every`` steps. A quick run shorter than the 30 warmup steps warms up over the
whole run (with a note). ``--show-config`` lists every key.
"""

from hybrid_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(dict(name="demo", vocab_size=512, hidden_size=64, pattern="*-G-K-S-", ffn_size=128,
                        num_layers=8, dtype="float32", chunk_size=16))
    c.model.gdn.update(dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16))
    c.model.kda.update(dict(num_key_heads=2, num_value_heads=2, key_head_dim=16, value_head_dim=32))
    c.model.mamba2.update(dict(state_dim=16, head_dim=16, num_groups=2, expand=2))
    c.model.mla.update(dict(num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, original_max_position_embeddings=128))
    c.train.update(dict(steps=300, global_batch_size=16, micro_batch_size=16, seq_len=64, lr=3e-3, min_lr=3e-4,
                        warmup_steps=30, log_every=25, save_every=100, eval_every=100, loss_chunk_size=256))
    return c
