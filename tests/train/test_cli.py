"""``python -m hybrid_jax.train``: clear config errors on the command line (the kill -9 cases: tests/faults)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = dict(  # tests/train/common.py's tiny_config as command-line overrides
    **{"model.pattern": "*-G-", "model.num_layers": 4, "model.hidden_size": 32, "model.ffn_size": 64,
       "model.vocab_size": 256},
    **{"train.global_batch_size": 16, "train.micro_batch_size": 2, "train.seq_len": 32, "train.warmup_steps": 5},
    **{"train.loss_chunk_size": 96},
)


def _command(workdir, **overrides) -> list[str]:
    args = {**TINY, "train.workdir": str(workdir), **overrides}
    return [sys.executable, "-m", "hybrid_jax.train", "--config", str(REPO / "configs" / "demo.py")] + [
        f"--config.{k}={v}" for k, v in args.items()
    ]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"train.nonexistent": 1}, "unknown config key 'nonexistent'"),
        ({"train.stpes": 10}, r"unknown config key 'stpes' .*; did you mean train.steps\?"),
        ({"train.steps": "abc"}, "--config.train.steps=abc: invalid literal for int"),
        (
            {"train.global_batch_size": 12, "train.micro_batch_size": 2},
            "global_batch_size=12 .* micro_batch_size=2 x data shards=8 = 16",
        ),
    ],
)
def test_config_errors_are_clear(tmp_path, overrides, message):
    out = subprocess.run(_command(tmp_path, **overrides), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), out.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()
