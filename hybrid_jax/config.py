"""The run configuration: one ml_collections ``ConfigDict`` holding everything a run needs.

``base_config()`` is the shared recipe (the Primus/FLA seed recipe: AdamW 0.9/0.95, weight decay 0.01,
clip 1.0, cosine to ``min_lr`` after a linear warmup (or WSD, or constant: ``train.lr_schedule``), seq 2048,
Llama-3 vocabulary). Each file in ``configs/`` states only what differs. The dict is locked, so an unknown override
key is an error.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict


def load_config_file(path: str | Path) -> ConfigDict:
    """``get_config()`` of a config file such as ``configs/demo.py``."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.model = ConfigDict(
        dict(
            name="",
            vocab_size=128256,  # Llama-3 tokenizer (Primus's configs)
            hidden_size=1024,
            num_layers=24,  # sublayers, Megatron style: every mixer and every MLP counts as one
            pattern="",  # explicit plan ("*-M-..."); empty: from num_layers and hybrid_attention_ratio
            hybrid_attention_ratio=0.0,
            mixer="gdn",  # what "M" in the plan means: gdn | kda | mamba2
            ffn_size=4096,
            tie_embeddings=True,  # the output layer is the embedding; False: a separate lm_head [V, D]
            norm_eps=1e-6,
            init_std=0.02,
            param_dtype="float32",
            dtype="bfloat16",  # compute dtype
            kernel_impl="auto",  # auto | xla | pallas | pallas_interpret | naive
            chunk_size=0,  # recurrent-kernel chunk (power of two >= 16); 0: tuned per GPU and mixer (kernels.tuning)
            tuning="auto",  # launch configs: auto (this GPU's file from python -m hybrid_jax.tune) | builtin | a path
            remat="none",  # none | mixer | full | dots
            reset_positions=False,  # with data.document_mask: RoPE positions restart at each document
            gdn=ConfigDict(
                dict(num_key_heads=4, num_value_heads=8, key_head_dim=64, value_head_dim=64, conv_size=4)
            ),
            kda=ConfigDict(
                dict(num_key_heads=8, num_value_heads=8, key_head_dim=32, value_head_dim=64, conv_size=4)
            ),
            mamba2=ConfigDict(
                dict(state_dim=64, head_dim=64, num_groups=8, expand=2, conv_size=4, norm_eps=1e-5)
            ),
            mla=ConfigDict(
                dict(
                    num_heads=16,
                    q_lora_rank=672,
                    kv_lora_rank=64,
                    qk_nope_head_dim=32,
                    qk_rope_head_dim=32,
                    v_head_dim=64,
                    rope_theta=500000.0,
                    rope_scaling_factor=1.0,  # YaRN; 1.0 is plain RoPE
                    original_max_position_embeddings=2048,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    mscale=1.0,
                    mscale_all_dim=1.0,
                )
            ),
        )
    )
    c.train = ConfigDict(
        dict(
            seed=42,
            steps=4768,
            global_batch_size=1024,  # sequences per optimizer step
            micro_batch_size=32,  # sequences per device per micro step
            seq_len=2048,
            lr=2e-4,
            min_lr=2e-5,
            warmup_steps=200,
            lr_schedule="cosine",  # cosine | wsd (warmup, stable, decay) | constant (hybrid_jax.train.step.schedule)
            decay_fraction=0.2,  # wsd: the decay takes the last round(decay_fraction x steps) steps
            decay_shape="1-sqrt",  # wsd: linear | cosine | 1-sqrt
            weight_decay=0.01,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            clip_norm=1.0,
            loss_chunk_size=4096,  # tokens per chunk of the LM-head cross-entropy (logits [chunk, vocab])
            zero1=False,
            max_skipped_in_a_row=10,
            workdir="",
            log_every=10,
            save_every=1000,
            keep_checkpoints=3,  # the newest N, plus the newest healthy one (no skipped step in a row)
            restore_step=0,  # resume from this checkpoint step, not the newest (0: the newest); newer ones set aside
            allow_config_change=False,  # resume even if the config changes what the model computes (rope_theta, dims)
            eval_every=1000,  # validation loss every N steps and at the end (needs data.validation_path); 0: off
            eval_batches=8,  # validation batches of micro_batch_size x data shards windows, the same at every eval
            branch_from="",  # WORKDIR[:STEP]: a new run starts from that checkpoint's state and data position
            eval_tasks="",  # lm-eval tasks of hybrid_jax/eval/tasks scored during training, e.g. "arc_easy,piqa"
            eval_tasks_every=1000,  # steps between task evaluations (and one at the end)
            eval_tasks_limit=100,  # documents per task (the first N of its evaluation split, the same every time)
            eval_tasks_data="",  # the tasks' data files (ARC / PIQA jsonl); empty: $HYBRID_JAX_EVAL_DATA
            wandb_project="",  # Weights & Biases project to log to as well (needs wandb); empty: off
            wandb_mode="online",  # online | offline (written under WORKDIR/wandb; `wandb sync` uploads it later)
        )
    )
    c.data = ConfigDict(
        dict(
            source="mock",  # mock | tokens | megatron
            path="",  # prepared shards (hybrid_jax.prepare --output), a Megatron prefix, or a blend "0.7 a 0.3 b"
            tokenizer="",  # empty with source=tokens: the tokenizer recorded in data.path's manifest
            validation_path="",  # held-out data: a dataset or blend as data.path, a .jsonl/.parquet, or "mock"
            num_workers=0,
            document_mask=False,  # packed documents kept apart (segment ids per token); False: the FLA/Primus recipe
        )
    )
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, context=1))  # data -1: all remaining devices; context: sequence split
    return c


def recipe_300m(c: ConfigDict) -> ConfigDict:
    """The 300M seed recipe: 10B tokens = 4768 steps x 1024 x 2048, lr 2e-4 -> 2e-5, warmup 200."""
    c.train.update(dict(steps=4768, global_batch_size=1024, seq_len=2048, lr=2e-4, min_lr=2e-5, warmup_steps=200))
    return c


def mamba_mla_config() -> ConfigDict:
    """Shared recipe of the Mamba2 + MLA Zebra-Llama family (1B/3B/8B): ratio 0.25, seq 8192, Mamba2 expand 1."""
    c = base_config()
    c.model.update(dict(num_layers=32, mixer="mamba2", hybrid_attention_ratio=0.25))
    c.model.mamba2.update(dict(expand=1, num_groups=8))
    c.model.mla.original_max_position_embeddings = 8192
    # Primus's Mamba+MLA pretrain recipe (lr 2e-4 -> 2e-5, warmup 200, 10000 decay steps, seq 8192).
    # Primus uses weight decay 0.1 here; we keep the project-wide 0.01 (override with --config.train.weight_decay).
    c.train.update(dict(steps=10000, seq_len=8192, lr=2e-4, min_lr=2e-5, warmup_steps=200, zero1=True))
    return c


def flat_items(tree: ConfigDict | dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a config (or its dict / JSON form) as ``("section.key", value)``, in order."""
    for key, value in tree.items():
        if isinstance(value, ConfigDict | dict):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def to_json(cfg: ConfigDict) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def from_json(text: str) -> ConfigDict:
    """Rebuild a locked config from :func:`to_json` output; a key the schema does not know is a ``KeyError``."""
    cfg = base_config()
    cfg.lock()
    _assign(cfg, json.loads(text), "")
    return cfg


def _assign(cfg: ConfigDict, values: dict, prefix: str) -> None:
    for key, value in values.items():
        if key not in cfg:
            raise KeyError(f"unknown config key '{prefix}{key}'; the schema is hybrid_jax.config.base_config()")
        if isinstance(value, dict):
            _assign(cfg[key], value, f"{prefix}{key}.")
        else:
            cfg[key] = value
