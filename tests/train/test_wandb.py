"""Optional Weights & Biases logging (train.wandb_project): the rows TensorBoard gets, offline without a network, one
W&B run per workdir (skipped without the wandb package); without it, one line before anything is built."""

import importlib.util

import pytest

from hybrid_jax.train.config_checks import ConfigError
from hybrid_jax.train.report.metrics import MetricsLogger, start_wandb
from tests.train.common import tiny_config

HAS_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.mark.skipif(HAS_WANDB, reason="wandb is installed")
def test_without_wandb_a_project_is_one_line(tmp_path):
    from hybrid_jax.train.preflight import preflight

    with pytest.raises(ConfigError, match=r"train.wandb_project=p needs wandb: pip install wandb"):
        preflight(tiny_config(str(tmp_path / "run"), wandb_project="p"))
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_metrics_go_to_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tiny_config(str(tmp_path), wandb_project="hybrid-jax-test", wandb_mode="offline")
    assert start_wandb(tiny_config(str(tmp_path))) is None  # off by default
    run = start_wandb(config)
    run_id = run.id
    logger = MetricsLogger(tmp_path, flops_per_token=1.0, tokens_per_step=10, total_steps=4, wandb_run=run)
    logger.log(2, {"loss": 3.5, "lr": 1e-3, "skipped": 0})
    logger.log_validation(2, {"val_loss": 3.25, "val_ppl": 25.8})
    logger.log_tasks(4, {"eval/piqa/acc": 0.5, "seconds": 1.5}, documents=3)
    logger.log(6, {"loss": 3.0})  # a step's row reaches the summary once a later step begins
    summary = {k: run.summary[k] for k in ("_step", "train/loss", "train/lr", "val/loss", "val/ppl", "eval/piqa/acc")}
    assert summary == {"_step": 4, "train/loss": 3.5, "train/lr": 1e-3, "val/loss": 3.25, "val/ppl": 25.8,
                       "eval/piqa/acc": 0.5}
    assert run.config["train"]["steps"] == 40
    logger.close()
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")  # for `wandb sync`
    assert (folder / f"run-{run_id}.wandb").stat().st_size > 0
    again = start_wandb(config)  # a resumed run continues the same W&B run
    assert again.id == run_id
    again.finish()
