"""layer_plan on every published config, and malformed patterns."""

import pytest

from hybrid_jax.model import layer_plan, sublayer_kinds
from tests.conftest import load_config

HYBRID_300M = "*-M-M-M-*-M-M-M-*-M-M-M-"
EXPECTED = {
    "demo": "*-G-K-S-",
    "zebra_300m_gdn": "M-" * 12,
    "zebra_300m_kda": "M-" * 12,
    "zebra_300m_gdn_hybrid": HYBRID_300M,
    "zebra_300m_mamba2_hybrid": HYBRID_300M,
    "zebra_1b_gdn": "M-" * 16,
    "zebra_1b_kda": "M-" * 16,
    "zebra_1b_mamba2_hybrid": "*-M-M-M-" * 4,
    "zebra_1b_kda_hybrid": "*-M-M-M-" * 4,
    "zebra_1b_gdn_hybrid": "M-" * 16,  # Primus's "hybrid" stack with hybrid_attention_ratio 0: no attention
    "zebra_3b": "*-M-M-M-" * 7,
    "zebra_8b": "*-M-M-M-" * 8,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layer_plan_of_every_config(name):
    cfg = load_config(name).model
    plan = layer_plan(cfg)
    assert plan == EXPECTED[name]
    assert len(plan) == (cfg.num_layers if not cfg.pattern else len(cfg.pattern))


def test_sublayer_kinds_resolve_the_mixer():
    cfg = load_config("zebra_300m_mamba2_hybrid").model
    kinds = sublayer_kinds(cfg)
    assert kinds[:4] == ["mla", "mlp", "mamba2", "mlp"]
    assert kinds.count("mla") == 3 and kinds.count("mamba2") == 9 and kinds.count("mlp") == 12
    assert sublayer_kinds(load_config("demo").model) == ["mla", "mlp", "gdn", "mlp", "kda", "mlp", "mamba2", "mlp"]


@pytest.mark.parametrize("pattern, char, pos", [("*-M-x-", "'x'", 4), ("M-M-E", "'E'", 4), ("?", "'?'", 0)])
def test_malformed_pattern_names_char_and_position(pattern, char, pos):
    cfg = load_config("demo").model
    cfg.pattern = pattern
    with pytest.raises(ValueError, match=rf"{char} at position {pos}"):
        layer_plan(cfg)
