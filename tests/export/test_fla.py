"""FLA format: export -> import round trip is exact (through a resumable checkpoint), hybrids are refused, FLA names
and shapes are checked, a broken FLA checkpoint names the offending key."""

import json

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("torch")

from hybrid_jax.export import fla  # noqa: E402
from hybrid_jax.export.import_fla import load_fla  # noqa: E402
from hybrid_jax.export.tensors import ExportError, flat_params, load_safetensors, save_safetensors  # noqa: E402
from hybrid_jax.export.writer import export_model  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.export.conftest import perturbed_model, tiny_config  # noqa: E402


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fla_round_trip_is_identical(kind, tmp_path):
    cfg = tiny_config(kind)
    model = perturbed_model(cfg)
    export_model(model, cfg, tmp_path / "fla", fmt="fla")
    written = json.loads((tmp_path / "fla" / "config.json").read_text())
    assert written["model_type"] == {"gdn": "gated_deltanet", "kda": "kda"}[kind]
    assert written["num_hidden_layers"] == 2 and written["tie_word_embeddings"] is True
    tensors = load_safetensors(tmp_path / "fla")
    assert tensors["model.layers.1.attn.b_proj.weight"].shape == (cfg.model[kind].num_value_heads, 64)

    from hybrid_jax.checkpoints import load
    from hybrid_jax.export.__main__ import main

    main(["--from-fla", str(tmp_path / "fla"), "--workdir", str(tmp_path / "run"), "--config",
          str(REPO / "configs" / "demo.py")])  # CLI import
    loaded, imported = load(tmp_path / "run", step=0)
    assert imported.model.to_dict() == cfg.model.to_dict() | {"num_layers": 4, "pattern": ""}
    before, after = flat_params(model), flat_params(loaded)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)

    main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "again"), "--format", "fla"])  # CLI export
    again = load_safetensors(tmp_path / "again")
    assert again.keys() == tensors.keys()
    for key in tensors:
        np.testing.assert_array_equal(again[key], tensors[key], err_msg=key)


@pytest.mark.parametrize("kind", ["mamba2_mla", "gdn_mla"])
def test_fla_refuses_hybrids(kind, tmp_path):
    cfg = tiny_config(kind)
    with pytest.raises(ExportError, match="pure GDN or pure KDA.*--format hf"):
        export_model(perturbed_model(cfg), cfg, tmp_path, fmt="fla")
    assert not any(tmp_path.iterdir())


def test_fla_refuses_grouped_kda_values(tmp_path):
    cfg = tiny_config("kda")
    cfg.model.kda.num_value_heads = 4
    with pytest.raises(ExportError, match="num_value_heads 4 != num_key_heads 2"):
        export_model(perturbed_model(cfg), cfg, tmp_path, fmt="fla")


def test_fla_shapes_check_names_the_key(tmp_path, monkeypatch):
    cfg = tiny_config("gdn")
    real = fla.to_fla
    monkeypatch.setattr(fla, "to_fla", lambda p, m: {k: v for k, v in real(p, m).items() if "o_norm" not in k})
    with pytest.raises(ExportError, match=r"missing tensor 'model\.layers\.0\.attn\.o_norm\.weight'"):
        export_model(perturbed_model(cfg), cfg, tmp_path, fmt="fla")


def test_import_names_missing_and_extra_keys(tmp_path):
    cfg = tiny_config("kda")
    export_model(perturbed_model(cfg), cfg, tmp_path, fmt="fla")
    tensors = load_safetensors(tmp_path)
    del tensors["model.layers.1.attn.f_proj.1.weight"]
    save_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match=r"missing tensor 'model\.layers\.1\.attn\.f_proj\.1\.weight'"):
        load_fla(tmp_path, cfg)
    tensors = load_safetensors(tmp_path) | {"model.layers.0.attn.q_conv1d.bias": np.zeros(32, np.float32),
                                            "model.layers.1.attn.f_proj.1.weight": np.zeros((32, 32), np.float32)}
    save_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match=r"unexpected tensor 'model\.layers\.0\.attn\.q_conv1d\.bias'"):
        load_fla(tmp_path, cfg)
