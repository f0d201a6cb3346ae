"""Config values that cannot train are one-line errors before anything is built (the command line's own: test_cli.py;
the faults an outside test found: tests/faults/test_input_faults.py)."""

import pytest

from hybrid_jax.train.config_checks import ConfigError, check_config
from tests.train.common import tiny_config


@pytest.mark.parametrize("key,value", [("hidden_size", -64), ("ffn_size", 0), ("mla.num_heads", 0),
                                       ("gdn.key_head_dim", -1), ("mla.kv_lora_rank", 0)])
def test_non_positive_model_sizes_are_refused(key, value):
    config = tiny_config()
    section, _, name = key.rpartition(".")
    (config.model[section] if section else config.model)[name] = value
    with pytest.raises(ConfigError, match=rf"^model.{key}={value} must be a positive integer$"):
        check_config(config, 8)
    assert check_config(tiny_config(), 8) == 1  # the unchanged config passes (chunk_size 0 allowed)


@pytest.mark.parametrize("overrides,message", [
    ({"pattern": "*-X-"}, r"^model: .*bad character 'X' at position 2"),
    ({"mixer": "rnn", "pattern": ""}, r"^model: model.mixer must be one of"),
    ({"chunk_size": 24}, r"^model.chunk_size=24 must be 0 \(tuned per GPU and mixer\) or a power of two >= 16$"),
])
def test_bad_model_choices_are_refused(overrides, message):
    config = tiny_config()
    config.model.update(overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(config, 8)
