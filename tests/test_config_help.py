"""``--show-config``: every key has a line of meaning; a mistyped key gets the nearest known ones."""

import subprocess
import sys

from hybrid_jax.config import base_config, flat_items
from hybrid_jax.config_help import MEANINGS, nearest_keys, show_config
from tests.conftest import REPO, load_config


def test_every_key_has_a_meaning_and_is_listed():
    keys = [k for k, _ in flat_items(base_config())]
    assert sorted(keys) == sorted(MEANINGS)  # a new key needs its line in hybrid_jax/config_help.py
    lines = show_config(load_config("demo")).splitlines()
    rows = {line.split()[0]: line for line in lines if line and line.split()[0] in MEANINGS}
    assert sorted(rows) == sorted(keys)
    assert rows["train.steps"].split()[1:4] == ["300", "(default", "4768)"]  # the demo's value, then the default
    assert "optimizer steps of the whole run" in rows["train.steps"]


def test_nearest_keys():
    assert nearest_keys("train.stpes") == ["train.steps"]
    assert nearest_keys("model.vocab") == ["model.vocab_size"]
    assert nearest_keys("data.tokeniser") == ["data.tokenizer"]
    assert nearest_keys("trian.steps")[0] == "train.steps"
    assert nearest_keys("train.nonexistent") == []


def test_cli_show_config_exits_before_training(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybrid_jax.train", "--config", str(REPO / "configs" / "demo.py"),
                          "--show-config", f"--config.train.workdir={tmp_path / 'run'}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("data.validation_path") for line in out.stdout.splitlines())
    assert not (tmp_path / "run").exists()
