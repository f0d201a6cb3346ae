"""Small configs for the trainer tests (derived from configs/demo.py, shrunk to compile and run fast)."""

from __future__ import annotations

from ml_collections import ConfigDict

from tests.conftest import load_config


def tiny_config(workdir: str = "", **train) -> ConfigDict:
    """The demo model with a shorter plan (MLA, GDN) and a short sequence; float32."""
    c = load_config("demo")
    c.model.update(dict(pattern="*-G-", num_layers=4, hidden_size=32, ffn_size=64, vocab_size=256, dtype="float32"))
    c.train.update(dict(steps=40, global_batch_size=16, micro_batch_size=2, seq_len=32, warmup_steps=5,
                        log_every=10, save_every=10, loss_chunk_size=96, workdir=workdir))
    c.train.update(train)
    return c


def run_config(workdir, **train) -> ConfigDict:
    """The tiny config as a short run: 20 steps, a checkpoint every 5 (the newest 3 kept), logged every 5."""
    return tiny_config(str(workdir), **{"steps": 20, "save_every": 5, "log_every": 5, **train})
