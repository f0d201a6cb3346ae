"""Checkpoints: exact resume (40 straight == 30 + restart to 40), retention, shape-mismatch refusal, load()."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax
from hybrid_jax.checkpoints import CheckpointReader
from hybrid_jax.train.checkpoint import Checkpointer
from hybrid_jax.train.loop import train
from hybrid_jax.train.optim import learning_rate_schedule
from tests.train.common import tiny_config


def _losses(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    record = train(tiny_config(str(workdir)), log=lambda *_: None)
    return workdir, record


def test_resume_is_exact(straight, tmp_path):
    workdir, record = straight
    assert record["step"] == 40 and record["skipped"] == 0
    losses = _losses(workdir)
    assert sorted(losses) == [10, 20, 30, 40]
    assert losses[40] < losses[10] - 0.3, losses  # it learns

    config = tiny_config(str(tmp_path))
    first = train(config, stop_after=30, log=lambda *_: None)
    assert first["step"] == 30
    assert Checkpointer(tmp_path).latest_step() == 30
    resumed = train(config, log=lambda *_: None)
    assert resumed["step"] == 40
    np.testing.assert_allclose(resumed["loss"], record["loss"], rtol=1e-6)
    np.testing.assert_allclose(resumed["grad_norm"], record["grad_norm"], rtol=1e-5)
    assert _losses(tmp_path) == pytest.approx(losses, rel=1e-6)


def test_keeps_newest_checkpoints_and_saves_config_and_metrics(straight):
    workdir, _ = straight
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    want = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device", "mfu", "memory_gib",
            "skipped"}
    for r in records:
        assert want <= set(r), r
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 8)
        assert r["mfu"] is None and r["skipped"] == 0  # CPU: no peak FLOP/s, so no MFU
    np.testing.assert_allclose([r["lr"] for r in records][-1], learning_rate_schedule(tiny_config().train)(39))
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [20, 30, 40]  # save_every 10, keep_checkpoints 3
    with CheckpointReader(workdir) as reader:
        assert reader.steps() == steps and reader.latest_step() == 40
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["model"]["pattern"] == "*-G-" and saved["train"]["steps"] == 40
    assert list((workdir / "tensorboard").iterdir())


def test_load_returns_the_trained_model(straight):
    workdir, _ = straight
    model, config = hybrid_jax.load(workdir)
    assert config.model.hidden_size == 32 and config.train.steps == 40
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with CheckpointReader(workdir) as reader:
        saved = reader.restore(
            {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)},
            step=30,
        )["params"]
    assert not np.array_equal(params["embed"]["embedding"], saved["embed"]["embedding"])  # newest is step 40
    model30, _ = hybrid_jax.load(workdir, step=30)
    np.testing.assert_array_equal(model30.embedding, saved["embed"]["embedding"])
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, config.model.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_checkpoint_of_another_shape_is_refused(straight):
    workdir, _ = straight
    other = tiny_config(str(workdir))
    other.model.ffn_size = 48
    want = r"params/layers/1/mlp/linear_fc1/kernel has shape \(32, 128\) in the checkpoint but \(32, 96\)"
    with pytest.raises(ValueError, match=want):
        train(other, log=lambda *_: None)
