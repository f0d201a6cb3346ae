"""Every published config loads, is locked against unknown keys, and round-trips through JSON."""

import json

import pytest

from hybrid_jax.config import from_json, to_json
from hybrid_jax.model.plan import layer_plan
from hybrid_jax.train.config_checks import check_config
from tests.conftest import REPO, load_config

CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py"))


def test_all_published_configs_exist():
    expected = {"demo", "zebra_300m_gdn", "zebra_300m_kda", "zebra_300m_gdn_hybrid", "zebra_300m_mamba2_hybrid",
                "zebra_1b_gdn", "zebra_1b_kda", "zebra_1b_mamba2_hybrid", "zebra_1b_kda_hybrid", "zebra_1b_gdn_hybrid",
                "zebra_1b_kda_hybrid_64k", "zebra_3b", "zebra_8b"}
    assert expected <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_round_trips_and_recipe(name):
    cfg = load_config(name)
    assert cfg.model.name == name
    assert from_json(to_json(cfg)).to_dict() == cfg.to_dict()
    assert (cfg.train.b1, cfg.train.b2, cfg.train.weight_decay, cfg.train.clip_norm) == (0.9, 0.95, 0.01, 1.0)
    layer_plan(cfg.model)


@pytest.mark.parametrize(
    "name,steps,batch,lr,min_lr,warmup",
    [
        ("zebra_300m_gdn", 4768, 1024, 2e-4, 2e-5, 200),
        ("zebra_300m_kda", 4768, 1024, 2e-4, 2e-5, 200),
        ("zebra_300m_gdn_hybrid", 4768, 1024, 2e-4, 2e-5, 200),
        ("zebra_300m_mamba2_hybrid", 4768, 1024, 2e-4, 2e-5, 200),
        ("zebra_1b_gdn", 95368, 512, 3e-4, 3e-5, 2000),
    ],
)
def test_seed_recipes(name, steps, batch, lr, min_lr, warmup):
    t = load_config(name).train
    assert (t.steps, t.global_batch_size, t.seq_len, t.lr, t.min_lr, t.warmup_steps) == (
        steps, batch, 2048, lr, min_lr, warmup)


def test_long_context_recipe_is_the_8k_model_split_over_8_devices():
    """``zebra_1b_kda_hybrid_64k``: the 8k KDA hybrid's model (rematerialised), 65536-token sequences split over
    ``mesh.context`` 8, micro batch 1, the 8k recipe's tokens per step; the config checks pass on 8 devices."""
    long, short = load_config("zebra_1b_kda_hybrid_64k"), load_config("zebra_1b_kda_hybrid")
    model = lambda c: {k: v for k, v in c.model.to_dict().items() if k not in ("name", "remat")}  # noqa: E731
    assert model(long) == model(short)
    t = long.train
    assert (t.seq_len, long.mesh.context, t.micro_batch_size, long.model.remat) == (65536, 8, 1, "full")
    assert t.global_batch_size * t.seq_len == short.train.global_batch_size * short.train.seq_len
    assert (t.steps, t.lr, t.min_lr, t.warmup_steps) == (short.train.steps, short.train.lr, short.train.min_lr,
                                                         short.train.warmup_steps)
    assert check_config(long, 8) == 1  # one batch shard: the 8 devices share each sequence


def test_unknown_keys_are_errors():
    cfg = load_config("demo")
    cfg.lock()
    with pytest.raises(AttributeError):
        cfg.train.stepz = 3
    bad = json.loads(to_json(cfg))
    bad["train"]["stepz"] = 3
    with pytest.raises(KeyError, match="train.stepz"):
        from_json(json.dumps(bad))
