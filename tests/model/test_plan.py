"""layer_plan on every published config, malformed patterns, and the plan keys that give a list of sublayers."""

import pytest
from ml_collections import ConfigDict

from hybrid_jax.model import layer_plan, sublayer_kinds
from hybrid_jax.model.plan import plan_fields
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
    "zebra_1b_kda_hybrid_64k": "*-M-M-M-" * 4,
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


@pytest.mark.parametrize("base, source, fields", [
    ("demo", "demo", {}),  # the base's own plan: nothing to change
    ("zebra_300m_gdn", "zebra_300m_kda", {"mixer": "kda"}),
    ("zebra_300m_gdn", "zebra_300m_gdn_hybrid",  # the ratio rule, ratio attention / mixers
     dict(pattern="", num_layers=24, hybrid_attention_ratio=0.25, mixer="gdn")),
    ("demo", "zebra_1b_gdn", dict(pattern="", num_layers=32, hybrid_attention_ratio=0.0, mixer="gdn")),
    ("zebra_8b", "demo", dict(pattern="*-G-K-S-", num_layers=8, mixer="mamba2")),  # several mixers: explicit
])
def test_plan_fields_change_as_little_as_they_can(base, source, fields):
    kinds = sublayer_kinds(load_config(source).model)
    base_cfg = load_config(base).model
    assert plan_fields(kinds, base_cfg) == fields
    assert sublayer_kinds(ConfigDict(base_cfg.to_dict() | fields)) == kinds


def test_plan_fields_write_a_pattern_where_no_ratio_gives_the_plan():
    kinds = ["mla", "mlp", "gdn", "mlp", "gdn", "mlp"]  # 1 MLA of 3 mixers: int(3 x 0.3333) = 0, not 1
    assert plan_fields(kinds, load_config("zebra_300m_gdn").model) == dict(pattern="*-M-M-", num_layers=6, mixer="gdn")
