"""``python -m hybrid_jax.train``: clear config errors, and exact resume after a SIGKILL in the middle of a save
(``metrics.jsonl`` then holds every step once)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
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
        ({"model.pattern": "*-X-"}, "bad character 'X' at position 2"),
        ({"model.mixer": "rnn", "model.pattern": ""}, "model.mixer must be one of"),
        ({"model.chunk_size": 24}, r"model.chunk_size=24 must be 0 \(tuned per GPU and mixer\) or a power of two"),
    ],
)
def test_config_errors_are_clear(tmp_path, overrides, message):
    out = subprocess.run(_command(tmp_path, **overrides), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), out.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


def _records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_resume_after_sigkill_during_a_save(tmp_path):
    cmd = _command(tmp_path, **{"train.steps": 20, "train.save_every": 1, "train.log_every": 1})
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    checkpoints, tmp_seen = tmp_path / "checkpoints", None
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        entries = list(checkpoints.iterdir()) if checkpoints.is_dir() else []
        complete = [p for p in entries if p.name.isdigit()]
        partial = [p.name for p in entries if not p.name.isdigit() and "tmp" in p.name]
        if len(complete) >= 2 and partial:
            proc.send_signal(signal.SIGKILL)
            tmp_seen = partial
            break
        time.sleep(0.002)
    proc.wait()
    log.close()
    assert tmp_seen, f"never saw a save in progress; rc={proc.returncode}"
    assert proc.returncode == -signal.SIGKILL
    before = {r["step"]: r["loss"] for r in _records(tmp_path)}  # what the killed run logged
    killed_at = max(before)
    assert killed_at < 20

    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed_from = int(out.stdout.split("resuming from")[1].split("step")[1].split()[0])
    assert resumed_from < killed_at  # it redid steps that the killed run had already logged

    after = _records(tmp_path)
    assert [r["step"] for r in after] == list(range(1, 21))  # the redone steps' old rows were dropped: each once
    redone = {r["step"]: r["loss"] for r in after if resumed_from < r["step"] <= killed_at}
    assert redone and min(redone) == resumed_from + 1
    for step, again in redone.items():
        assert again == pytest.approx(before[step], rel=1e-6), step  # the redone steps match the killed run's
