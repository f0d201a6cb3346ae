"""One line of meaning per config key, ``--show-config``'s listing, and the nearest keys to a mistyped one.

:data:`MEANINGS` covers every key of :func:`hybrid_jax.config.base_config` (a test keeps it so): a new key needs
its line here.
"""

from __future__ import annotations

import difflib

from ml_collections import ConfigDict

from hybrid_jax.config import base_config, flat_items

MEANINGS: dict[str, str] = {
    "model.name": "the run's name; an empty train.workdir becomes runs/<name>",
    "model.vocab_size": "embedding rows; at least the tokenizer's ids (Llama-2 32000, Llama-3 128256)",
    "model.hidden_size": "the residual stream's width",
    "model.num_layers": "sublayers (every mixer and every MLP counts one), when model.pattern is empty",
    "model.pattern": "explicit plan: * MLA, - MLP, M model.mixer, G GDN, K KDA, S Mamba2 (empty: from the ratio)",
    "model.hybrid_attention_ratio": "share of mixers that are MLA when the plan is derived (Primus's rule)",
    "model.mixer": "what M in the plan means: gdn | kda | mamba2",
    "model.ffn_size": "SwiGLU MLP inner width",
    "model.tie_embeddings": "the output layer is the embedding (True) or its own lm_head [vocab, hidden] (False)",
    "model.norm_eps": "RMSNorm epsilon",
    "model.init_std": "standard deviation of the normal weight init",
    "model.param_dtype": "dtype of the master weights (float32)",
    "model.dtype": "compute dtype (bfloat16 on GPU; float32 on CPU tests)",
    "model.kernel_impl": "kernels (recurrences, attention, loss, SwiGLU, conv): auto|xla|pallas|pallas_interpret|naive",
    "model.chunk_size": "recurrent-kernel chunk, a power of two >= 16; 0: tuned per GPU and mixer",
    "model.tuning": "kernel launch configs: auto (this GPU's tuning file) | builtin | a path",
    "model.remat": "recompute in the backward pass to save memory: none | mixer | full | dots (all, keeping the "
                   "projections' outputs)",
    "model.reset_positions": "with data.document_mask: RoPE positions restart at each document",
    "model.gdn.num_key_heads": "GDN query/key heads",
    "model.gdn.num_value_heads": "GDN value heads (a multiple of the key heads)",
    "model.gdn.key_head_dim": "GDN key/query head dimension",
    "model.gdn.value_head_dim": "GDN value head dimension",
    "model.gdn.conv_size": "GDN short causal convolution width",
    "model.kda.num_key_heads": "KDA query/key heads",
    "model.kda.num_value_heads": "KDA value heads (a multiple of the key heads)",
    "model.kda.key_head_dim": "KDA key/query head dimension",
    "model.kda.value_head_dim": "KDA value head dimension",
    "model.kda.conv_size": "KDA short causal convolution width",
    "model.mamba2.state_dim": "Mamba2 SSM state size (N)",
    "model.mamba2.head_dim": "Mamba2 head dimension (P)",
    "model.mamba2.num_groups": "Mamba2 B/C groups",
    "model.mamba2.expand": "Mamba2 inner width = expand x hidden_size",
    "model.mamba2.conv_size": "Mamba2 short causal convolution width",
    "model.mamba2.norm_eps": "Mamba2 gated RMSNorm epsilon",
    "model.mla.num_heads": "MLA attention heads",
    "model.mla.q_lora_rank": "MLA query low-rank width (0: no query compression)",
    "model.mla.kv_lora_rank": "MLA latent KV width (what the cache stores)",
    "model.mla.qk_nope_head_dim": "MLA query/key dimension without RoPE",
    "model.mla.qk_rope_head_dim": "MLA query/key dimension with RoPE",
    "model.mla.v_head_dim": "MLA value head dimension",
    "model.mla.rope_theta": "RoPE base",
    "model.mla.rope_scaling_factor": "YaRN context extension factor; 1.0 is plain RoPE",
    "model.mla.original_max_position_embeddings": "YaRN's original context length",
    "model.mla.beta_fast": "YaRN beta_fast",
    "model.mla.beta_slow": "YaRN beta_slow",
    "model.mla.mscale": "YaRN mscale",
    "model.mla.mscale_all_dim": "YaRN mscale_all_dim",
    "train.seed": "seed of the init, the data order and the mock chain",
    "train.steps": "optimizer steps of the whole run (the schedule's length)",
    "train.global_batch_size": "sequences per optimizer step = micro_batch_size x accumulation x data shards",
    "train.micro_batch_size": "sequences per device per micro step (lower it on out-of-memory)",
    "train.seq_len": "tokens per training sequence",
    "train.lr": "peak learning rate",
    "train.min_lr": "learning rate at the end of the cosine or WSD decay",
    "train.warmup_steps": "linear warmup steps (a warmup longer than the run is cut to the run)",
    "train.lr_schedule": "cosine (to min_lr at train.steps) | wsd (warmup, stable, decay at the end) | constant",
    "train.decay_fraction": "wsd: the decay takes the last round(decay_fraction x steps) steps",
    "train.decay_shape": "wsd: the decay's shape from lr to min_lr: linear | cosine | 1-sqrt",
    "train.weight_decay": "AdamW weight decay on matrices",
    "train.b1": "AdamW beta1",
    "train.b2": "AdamW beta2",
    "train.eps": "AdamW epsilon",
    "train.clip_norm": "global gradient-norm clip",
    "train.loss_chunk_size": "tokens per chunk of the cross-entropy (bounds the logits' memory)",
    "train.zero1": "shard the AdamW moments over the data-parallel devices (ZeRO-1)",
    "train.max_skipped_in_a_row": "stop after this many non-finite steps in a row",
    "train.workdir": "run directory (config, checkpoints, metrics); rerunning resumes there; empty: runs/<name>",
    "train.log_every": "steps between metrics lines (console, metrics.jsonl, TensorBoard)",
    "train.save_every": "steps between checkpoints (one is also written at the end and on Ctrl-C)",
    "train.keep_checkpoints": "newest checkpoints kept (plus the newest healthy one)",
    "train.restore_step": "resume from this checkpoint step instead of the newest (0: the newest)",
    "train.allow_config_change": "resume even when the config changes what the model computes",
    "train.eval_every": "steps between validation losses (needs data.validation_path); 0: none",
    "train.eval_batches": "validation batches (micro_batch_size x data shards windows each), fixed for the run",
    "train.branch_from": "WORKDIR[:STEP]: start this new workdir from that checkpoint (default its newest)",
    "train.eval_tasks": "lm-eval tasks scored during training (arc_easy, arc_challenge, piqa, hellaswag); empty: none",
    "train.eval_tasks_every": "steps between task evaluations (one more at the end)",
    "train.eval_tasks_limit": "documents per task evaluation (the first N, the same every time)",
    "train.eval_tasks_data": "folder of the tasks' jsonl files; empty: $HYBRID_JAX_EVAL_DATA",
    "train.wandb_project": "also log to this Weights & Biases project (needs wandb); empty: off",
    "train.wandb_mode": "W&B mode: online | offline (saved under WORKDIR/wandb, `wandb sync` uploads it)",
    "data.source": "mock (a built-in Markov chain, no files) | tokens (prepared shards) | megatron (.bin/.idx)",
    "data.path": "a prepare --output directory, a Megatron path prefix, or a blend '0.7 a 0.3 b' of them",
    "data.tokenizer": "tokenizer file; empty with source=tokens: the one recorded in data.path's manifest",
    "data.validation_path": "held-out data: a dataset or blend as data.path, a .jsonl/.parquet of documents, or mock",
    "data.document_mask": "keep packed documents apart (states, convs, attention restart at each document)",
    "data.num_workers": "Grain worker processes reading the data (0: in the trainer's process)",
    "mesh.data": "data-parallel mesh axis size; -1: all remaining devices",
    "mesh.fsdp": "parameter-sharding mesh axis size (ZeRO-3 style), 1: replicated",
    "mesh.context": "sequence-parallel mesh axis size: each sequence split over this many devices, 1: off",
}


def show_config(config: ConfigDict) -> str:
    """Every key as ``key = value  meaning``, with the base default where the config file changes it."""
    base = dict(flat_items(base_config()))
    rows = []
    for key, value in flat_items(config):
        shown = repr(value) if isinstance(value, str) else str(value)
        if key in base and base[key] != value:
            shown += f" (default {base[key]!r})"
        rows.append((key, shown, MEANINGS.get(key, "")))
    width_key, width_value = max(len(r[0]) for r in rows), min(max(len(r[1]) for r in rows), 28)
    lines = [f"{k:<{width_key}}  {v:<{width_value}}  {m}" for k, v, m in rows]
    return "\n".join(lines + ["", "override any of them with --config.KEY=VALUE, e.g. --config.train.steps=100"])


def nearest_keys(name: str, *, n: int = 3) -> list[str]:
    """The known keys closest to a mistyped dotted ``name`` (whole, then by its last part within its section)."""
    keys = [k for k, _ in flat_items(base_config())]
    section, _, tail = name.rpartition(".")
    pool = [k for k in keys if k.startswith(section + ".")] if section else keys
    by_tail: dict[str, list[str]] = {}
    for k in pool or keys:
        by_tail.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    near = []
    for t in difflib.get_close_matches(tail, list(by_tail), n=n, cutoff=0.6):
        near += by_tail[t]
    near += difflib.get_close_matches(name, keys, n=n, cutoff=0.85)  # a mistyped section
    return list(dict.fromkeys(near))[:n]
