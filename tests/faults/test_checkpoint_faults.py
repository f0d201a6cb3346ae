"""Checkpoints that an outside fault made untrustworthy: the keep policy across restarts, verified reads, damaged
or unsigned checkpoints, cut metrics and configs, and a refused resume that must leave the workdir as it was."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import hybrid_jax
from hybrid_jax.checkpoints import CheckpointDamaged, Checkpointer, ConfigChangeRefused, integrity, latest_step, layout
from hybrid_jax.train.loop import train
from tests.faults.conftest import run_config, snapshot


def _state(value: float, skipped_in_a_row: int) -> dict:
    return dict(params=dict(w=jnp.full((8, 8), value)), skipped_in_a_row=jnp.asarray(skipped_in_a_row, jnp.int32))


def test_the_newest_healthy_checkpoint_survives_a_restart(tmp_path):
    """Issue item 1: health used to live only in the saving process's memory; after a restart every checkpoint read
    back from disk counted as healthy and the last good one was rotated out."""
    config = run_config(tmp_path, keep_checkpoints=2, save_every=1)
    first = Checkpointer(tmp_path, config)
    for step, skipped in ((10, 0), (20, 3)):  # a healthy checkpoint, then one saved amid skipped steps
        assert first.save(step, _state(step, skipped), {"sequences": step}, force=True)
    first.wait()
    first.close()
    restarted = Checkpointer(tmp_path, config)  # a new process (kill -9, requeue) keeps saving unhealthy steps
    for step in (30, 40):
        assert restarted.save(step, _state(step, 5), {"sequences": step}, force=True)
    restarted.wait()
    restarted.close()
    assert layout.saved_steps(tmp_path) == [10, 30, 40]  # the newest 2, and the newest healthy one
    assert integrity.skipped_in_a_row(layout.step_dir(tmp_path, 10)) == 0


def test_load_refuses_a_checkpoint_with_a_changed_byte(run_copy):
    """Item 2: ``hybrid_jax.load`` (export, eval, generate, the notebook) read damaged weights without a word."""
    newest = layout.step_dir(run_copy, 20)
    largest = max((p for p in (newest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged) as e:
        hybrid_jax.load(run_copy)
    name = largest.relative_to(newest)
    assert str(e.value) == (f"checkpoint step 20 of {run_copy} is damaged: {name} does not match its SHA-256 (the "
                            "data changed after it was written); load another step ([10, 15])")
    model, config = hybrid_jax.load(run_copy, step=15)  # another step still loads
    assert config.train.steps == 20 and model.embedding.shape == (256, 32)


def test_damaged_checkpoints_cut_metrics_and_a_garbled_config_are_set_aside_or_repaired(run_copy):
    """Items 4, 5, 7: a deleted ``_METADATA`` (once a 22-line AttributeError on every rerun), a deleted
    ``integrity.json`` (once: checksums silently off), a cut last line of ``metrics.jsonl`` and a garbage
    ``config.json`` (once: tracebacks on every resume)."""
    (layout.step_dir(run_copy, 20) / "state" / "_METADATA").unlink()
    (layout.step_dir(run_copy, 15) / integrity.MANIFEST).unlink()
    with open(run_copy / layout.METRICS, "a") as f:
        f.write('{"step": 25, "loss": 1.2')  # a write cut short by kill -9
    (run_copy / layout.CONFIG).write_text("{garbage")
    lines = []
    train(run_config(run_copy), stop_after=10, log=lambda *a: lines.append(" ".join(map(str, a))))
    text = "\n".join(lines)
    quarantine = run_copy / layout.QUARANTINE
    assert "checkpoint step 20 is unusable: state/_METADATA is missing; moved to" in text, text
    assert ("checkpoint step 15 is unusable: it has no integrity.json (every checkpoint this trainer writes has one); "
            "moved to") in text, text
    assert f"resuming from {run_copy / 'checkpoints'} step 10" in text
    assert sorted(p.name for p in quarantine.iterdir() if p.is_dir()) == ["15", "20"]
    assert f"note: {run_copy / layout.CONFIG} is unreadable: moved to" in text
    assert "note: rebuilt" in text and json.loads((run_copy / layout.CONFIG).read_text())["train"]["steps"] == 20
    readme = (quarantine / "README.txt").read_text().splitlines()
    assert len(readme) == 3 and "config.json -> config.json: unreadable" in readme[-1]
    rows = (run_copy / layout.METRICS).read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [5, 10]  # the cut line and the rows after step 10 dropped
    assert latest_step(run_copy) == 10


def test_a_deleted_config_is_rebuilt_from_the_checkpoint_not_from_the_resumed_run(run_copy):
    """Item 7: a deleted ``config.json`` was rewritten from the resuming command's config, changes and all."""
    start = (run_copy / layout.CONFIG).read_text()
    (run_copy / layout.CONFIG).unlink()
    lines = []
    train(run_config(run_copy, lr=1e-3), stop_after=20, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any(line.startswith("note: rebuilt") for line in lines), lines
    assert json.loads((run_copy / layout.CONFIG).read_text()) == json.loads(start)
    assert json.loads((run_copy / "config-21.json").read_text())["train"]["lr"] == 1e-3


def test_a_refused_resume_changes_nothing_on_disk(run_copy):
    """Item 12: ``restore_step`` with a changed ``rope_theta`` moved the newer checkpoints and wrote
    ``restore_step.json`` before refusing."""
    config = run_config(run_copy, restore_step=10)
    config.model.mla.rope_theta = 10000.0
    before = snapshot(run_copy)
    with pytest.raises(ConfigChangeRefused, match=r"model.mla.rope_theta changed"):
        train(config, log=lambda *_: None)
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("key,value", [("seq_len", 48), ("seed", 7)])
def test_a_change_of_the_data_order_is_refused_then_announced_when_allowed(run_copy, key, value):
    """Item 9: a new ``seq_len`` or ``seed`` moved the data position silently (and a new mock seed swapped the
    task); the saved position now counts sequences, so a new batch size continues exactly (tests/data)."""
    before = snapshot(run_copy)
    with pytest.raises(ConfigChangeRefused, match=rf"train.{key} changed .* the order of its data"):
        train(run_config(run_copy, **{key: value}), log=lambda *_: None)
    assert snapshot(run_copy) == before
    lines = []
    train(run_config(run_copy, **{key: value, "allow_config_change": True}), stop_after=20,
          log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any(line.startswith(f"note: train.{key} changed") for line in lines), lines
    assert any(f"train.{key}: " in line and line.startswith("config changed from step 21") for line in lines)
    np.testing.assert_equal(json.loads((run_copy / "config-21.json").read_text())["train"][key], value)
