"""Checkpoint saves and their integrity data, without training: when saves happen, the manifest, fast failures."""

import time

import jax.numpy as jnp
import pytest

from hybrid_jax.checkpoints import Checkpointer, CheckpointSaveError, integrity
from tests.train.common import tiny_config

POSITION = dict(sequences=0)


def _state(value: float) -> dict:
    return dict(params=dict(w=jnp.full((64, 64), value)), skipped_in_a_row=jnp.zeros((), jnp.int32))


def test_saves_follow_save_every_carry_checksums_and_fail_fast_in_one_line(tmp_path):
    ckpt = Checkpointer(tmp_path, tiny_config(save_every=10))
    assert not ckpt.manager.should_save(1) and ckpt.manager.should_save(10)  # no Orbax initial save at step 1
    assert [ckpt.save(s, _state(float(s)), POSITION) for s in (1, 5, 10)] == [False, False, True]
    ckpt.wait()
    step = tmp_path / "checkpoints" / "10"
    assert integrity.verify(step) is None
    largest = max((p for p in step.rglob("*") if p.is_file() and p.name != integrity.MANIFEST),
                  key=lambda p: p.stat().st_size)
    name, size = str(largest.relative_to(step)), largest.stat().st_size
    largest.write_bytes(largest.read_bytes()[: size // 2])  # truncated
    assert integrity.verify(step) == f"{name} has {size // 2} bytes, {size} were written"
    largest.unlink()
    assert integrity.verify(step) == f"{name} is missing"
    (step / "_CHECKPOINT_METADATA").write_text("{not json")  # the step's metadata garbled (Orbax rewrites it)
    assert integrity.verify(step) == "_CHECKPOINT_METADATA is not readable JSON"

    folder = tmp_path / "checkpoints"  # the folder goes away mid-run (unmounted, replaced): the next save says so
    folder.rename(tmp_path / "elsewhere")
    folder.write_text("")
    start = time.perf_counter()
    with pytest.raises(CheckpointSaveError) as error:
        ckpt.save(20, _state(20.0), POSITION)
    assert time.perf_counter() - start < 20
    message = str(error.value)
    assert message.startswith(f"saving the checkpoint of step 20: checkpoint folder {folder} ") and "\n" not in message
    with pytest.raises(CheckpointSaveError, match=rf"checkpoint folder {folder} is not a folder; free space"):
        Checkpointer(tmp_path, tiny_config())
