"""FLA format: export -> import round trip is exact (through a resumable checkpoint), hybrids are refused, FLA names
and shapes are checked, a broken FLA checkpoint names the offending key."""

import json

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("torch")

from hybrid_jax.export import fla  # noqa: E402
from hybrid_jax.export.imports import load_fla  # noqa: E402
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


# FLA's GatedDeltaNetConfig fields of a tiny untied model (FLA's default tie_word_embeddings=False), grouped values
UNTIED_GDN = dict(model_type="gated_deltanet", architectures=["GatedDeltaNetForCausalLM"], attn_mode="chunk",
                  hidden_size=64, num_heads=2, num_v_heads=4, head_dim=16, expand_v=1.0, use_gate=True,
                  use_short_conv=True, conv_size=4, allow_neg_eigval=False, num_hidden_layers=2,
                  intermediate_size=128, hidden_act="swish", norm_eps=1e-6, vocab_size=97, tie_word_embeddings=False)


def test_untied_fla_checkpoint_imports_and_matches_pytorch(tmp_path, capsys):
    """An FLA-layout checkpoint with its own lm_head (drawn here, not exported by us) imports through the CLI into
    model.tie_embeddings=False; our logits equal a PyTorch forward of FLA's layers on its tensors; the printed
    command holds only the model keys that differ from the --config file."""
    from hybrid_jax.checkpoints import load
    from hybrid_jax.export.__main__ import main
    from tests.export.conftest import logits
    from tests.export.fla_torch import fla_gdn_logits, random_fla_tensors

    tensors = random_fla_tensors(UNTIED_GDN)
    assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embeddings.weight"])
    (tmp_path / "fla").mkdir()
    save_safetensors(tensors, tmp_path / "fla" / "model.safetensors")
    (tmp_path / "fla" / "config.json").write_text(json.dumps(UNTIED_GDN))

    main(["--from-fla", str(tmp_path / "fla"), "--workdir", str(tmp_path / "run"), "--config",
          str(REPO / "configs" / "demo.py")])
    command = capsys.readouterr().out.splitlines()[-1].split()
    assert command[6:] == ["--config.model.num_layers=4", "--config.model.pattern=''",
                           "--config.model.tie_embeddings=False", "--config.model.vocab_size=97"]
    model, config = load(tmp_path / "run", step=0)
    assert config.model.tie_embeddings is False
    np.testing.assert_array_equal(model.lm_head[...], tensors["lm_head.weight"])

    ids = np.random.default_rng(1).integers(0, 97, (2, 37), dtype=np.int32)
    ours, theirs = logits(model, ids), fla_gdn_logits(tensors, UNTIED_GDN, ids)
    assert np.abs(theirs - ours).max() <= 1e-4
    assert np.abs(ours).max() > 0.1  # not trivially small

    main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "again"), "--format", "fla"])  # and back out
    assert json.loads((tmp_path / "again" / "config.json").read_text())["tie_word_embeddings"] is False
    again = load_safetensors(tmp_path / "again")
    assert again.keys() == tensors.keys()
    for key in tensors:
        np.testing.assert_array_equal(again[key], tensors[key], err_msg=key)


def test_tied_fla_config_with_a_different_lm_head_is_refused(tmp_path):
    cfg = tiny_config("gdn")
    export_model(perturbed_model(cfg), cfg, tmp_path, fmt="fla")
    tensors = load_safetensors(tmp_path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    save_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match="differs from 'model.embeddings.weight' although its config.json says "
                                          "tie_word_embeddings=true"):
        load_fla(tmp_path, cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    imported, params = load_fla(tmp_path, cfg)  # the same tensors under an untied config: imported as they are
    assert imported.model.tie_embeddings is False
    np.testing.assert_array_equal(params["lm_head"], tensors["lm_head.weight"])
