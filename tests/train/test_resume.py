"""Checkpoints: exact resume (20 straight == 15 + restart to 20), retention, shape-mismatch refusal, load();
a corrupted checkpoint's fallback, train.restore_step, the config history, the workdir lock."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax
from hybrid_jax.checkpoints import (
    CheckpointReader,
    ConfigChangeRefused,
    NoUsableCheckpoint,
    WorkdirLocked,
    integrity,
    latest_step,
    read_config,
)
from hybrid_jax.train.loop import train
from hybrid_jax.train.step.optim import learning_rate_schedule
from tests.train.common import run_config


def _losses(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _last(workdir) -> dict:
    return json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])


def test_resume_is_exact(finished_run, tmp_path):
    record = _last(finished_run)
    assert record["step"] == 20 and record["skipped"] == 0
    losses = _losses(finished_run)
    assert sorted(losses) == [5, 10, 15, 20]
    assert losses[20] < losses[5] - 0.3, losses  # it learns

    config = run_config(tmp_path)
    first = train(config, stop_after=15, log=lambda *_: None)
    assert first["step"] == 15
    assert latest_step(tmp_path) == 15
    resumed = train(config, log=lambda *_: None)
    assert resumed["step"] == 20
    np.testing.assert_allclose(resumed["loss"], record["loss"], rtol=1e-6)
    np.testing.assert_allclose(resumed["grad_norm"], record["grad_norm"], rtol=1e-5)
    assert _losses(tmp_path) == pytest.approx(losses, rel=1e-6)


def test_keeps_newest_checkpoints_and_saves_config_and_metrics(finished_run):
    workdir = finished_run
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    want = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device", "mfu", "memory_gib",
            "skipped"}
    for r in records:
        assert want <= set(r), r
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 8)
        assert r["mfu"] is None and r["skipped"] == 0  # CPU: no peak FLOP/s, so no MFU
    np.testing.assert_allclose([r["lr"] for r in records][-1], learning_rate_schedule(run_config("").train)(19),
                               rtol=1e-6)
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 15, 20]  # save_every 5, keep_checkpoints 3
    with CheckpointReader(workdir) as reader:
        assert reader.steps() == steps and reader.latest_step() == 20
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["model"]["pattern"] == "*-G-" and saved["train"]["steps"] == 20
    assert list((workdir / "tensorboard").iterdir())


def test_load_returns_the_trained_model(finished_run):
    workdir = finished_run
    model, config = hybrid_jax.load(workdir)
    assert config.model.hidden_size == 32 and config.train.steps == 20
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with CheckpointReader(workdir) as reader:
        saved = reader.restore(
            {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)},
            step=15,
        )["params"]
    assert not np.array_equal(params["embed"]["embedding"], saved["embed"]["embedding"])  # newest is step 20
    model15, _ = hybrid_jax.load(workdir, step=15)
    np.testing.assert_array_equal(model15.embedding, saved["embed"]["embedding"])
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, config.model.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_checkpoint_of_another_shape_is_refused(finished_run):
    other = run_config(finished_run)
    other.model.ffn_size = 48
    want = r"params/layers/1/mlp/linear_fc1/kernel has shape \(32, 128\) in the checkpoint but \(32, 96\)"
    with pytest.raises(ValueError, match=want):
        train(other, log=lambda *_: None)


# --- checkpoints you can trust: verified restores, restore_step, config history, one run per workdir -----------


def test_corrupted_checkpoint_falls_back_to_the_previous_one_with_an_identical_continuation(finished_run, run_copy):
    run = run_copy
    newest = run / "checkpoints" / "20"
    files = json.loads((newest / "integrity.json").read_text())["files"]
    assert "state/_METADATA" in files and "data/metadata" in files and "config.json" in files
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:  # 16 KiB of garbage over the largest data file, size unchanged
        f.seek(64)
        f.write(np.random.default_rng(0).integers(0, 256, 16384, dtype=np.uint8).tobytes())
    lines: list[str] = []
    resumed = train(run_config(run), log=lambda *a: lines.append(" ".join(map(str, a))))
    name = str(largest.relative_to(newest))
    assert f"checkpoint step 20 is unusable: {name} does not match its SHA-256" in "\n".join(lines), lines
    assert any(line.startswith("resuming from") and line.endswith("step 15") for line in lines), lines
    np.testing.assert_allclose(resumed["loss"], _last(finished_run)["loss"], rtol=1e-6)  # 16..20 again, as before
    np.testing.assert_allclose(resumed["grad_norm"], _last(finished_run)["grad_norm"], rtol=1e-5)
    quarantined = run / "checkpoints-quarantine"
    assert (quarantined / "20" / name).is_file()  # moved aside, not deleted
    note = (quarantined / "README.txt").read_text().splitlines()
    assert len(note) == 1 and "checkpoint step 20 -> 20" in note[0] and name in note[0]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [10, 15, 20]
    assert integrity.verify(run / "checkpoints" / "20") is None  # the new step 20, written again


def test_restore_step_rewinds_and_sets_the_newer_checkpoints_aside(finished_run, run_copy):
    run = run_copy
    with pytest.raises(NoUsableCheckpoint, match=r"restore_step=12: .* no checkpoint at step 12 \(it has \[10, 15"):
        train(run_config(run, restore_step=12), log=lambda *_: None)
    lines: list[str] = []
    config = run_config(run, restore_step=10)
    resumed = train(config, log=lambda *a: lines.append(" ".join(map(str, a))))
    text = "\n".join(lines)
    assert "checkpoint step 15 set aside (newer than train.restore_step=10)" in text, text
    assert "resuming from" in text and text.count("set aside") == 2
    assert sorted(p.name for p in (run / "checkpoints-quarantine").iterdir() if p.is_dir()) == ["15", "20"]
    np.testing.assert_allclose(resumed["loss"], _last(finished_run)["loss"], rtol=1e-6)  # 11..20 again
    losses = _losses(run)
    assert losses[15] == pytest.approx(_losses(finished_run)[15], rel=1e-6)
    lines.clear()  # the same command again: it does not rewind a second time
    train(config, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any("train.restore_step=10 was applied already" in line for line in lines), lines
    assert any("nothing to do: the checkpoint is at step 20" in line for line in lines), lines


def test_a_changed_config_is_recorded_and_a_model_change_refused(run_copy):
    run = run_copy
    start = (run / "config.json").read_text()
    other = run_config(run)
    other.model.mla.rope_theta = 10000.0
    with pytest.raises(ConfigChangeRefused, match=r"model.mla.rope_theta changed .*500000.0 -> 10000.0.* "
                                                  r"--config.train.allow_config_change=true"):
        train(other, log=lambda *_: None)
    lines: list[str] = []
    train(run_config(run, lr=2e-3), log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any("config changed from step 21 (saved as config-21.json" in line and "train.lr: 0.003 -> 0.002" in line
               for line in lines), lines
    assert (run / "config.json").read_text() == start
    assert json.loads((run / "config-21.json").read_text())["train"]["lr"] == 2e-3
    other.train.allow_config_change = True
    train(other, log=lambda *_: None)
    assert json.loads((run / "config-21.json").read_text())["model"]["mla"]["rope_theta"] == 10000.0
    _, config = hybrid_jax.load(run)  # checkpoint 20 was trained with the config of config.json
    assert config.model.mla.rope_theta == 500000.0 and config.train.lr == 3e-3
    assert read_config(run, 21).model.mla.rope_theta == 10000.0


def test_a_second_run_on_the_workdir_is_refused_and_a_dead_runs_lock_taken_over(run_copy):
    run = run_copy
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from hybrid_jax.checkpoints.lock import WorkdirLock; "
         "WorkdirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)", str(run)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(WorkdirLocked, match=rf"{run} is in use by another run \(pid {holder.pid} on "):
            train(run_config(run), log=lambda *_: None)
    finally:
        holder.kill()
        holder.wait()
    lines: list[str] = []
    train(run_config(run), log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any(f"took over the lock of a run that has ended (pid {holder.pid} on" in line for line in lines)
    assert not (run / "train.lock").exists()  # released at the end
