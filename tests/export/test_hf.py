"""HF export: the shipped PyTorch modeling file reproduces our logits; names and shapes are checked."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybrid_jax.export.tensors import ExportError  # noqa: E402
from hybrid_jax.export.writer import export_model  # noqa: E402
from tests.export.conftest import logits, perturbed_model, tiny_config, tokens  # noqa: E402


def test_hf_logits_match_jax(kind, tmp_path):
    cfg = tiny_config(kind)
    model = perturbed_model(cfg)
    x = tokens(cfg)
    ours = logits(model, x)
    export_model(model, cfg, tmp_path, fmt="hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(x).long()).logits.numpy()
    assert theirs.shape == ours.shape == (2, 37, cfg.model.vocab_size)
    assert np.abs(theirs - ours).max() <= 1e-4
    assert np.abs(ours).max() > 0.1  # not trivially small
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["auto_map"]["AutoModelForCausalLM"] == "modeling_hybrid.HybridJaxForCausalLM"
    assert (tmp_path / "README.md").read_text().count("Final training loss") == 1


def test_hf_export_names_offending_key(tmp_path, monkeypatch):
    from hybrid_jax.export import hf

    cfg = tiny_config("gdn_mla")
    model = perturbed_model(cfg)
    real = hf.to_hf

    def broken(params):  # a map that gets one shape wrong
        out = real(params)
        out["model.layers.2.mixer.A_log"] = out["model.layers.2.mixer.A_log"][:-1]
        return out

    monkeypatch.setattr(hf, "to_hf", broken)
    with pytest.raises(ExportError, match=r"'model\.layers\.2\.mixer\.A_log' has shape \(3,\), expected \(4,\)"):
        export_model(model, cfg, tmp_path / "out", fmt="hf")
    assert not (tmp_path / "out").exists()  # nothing written on a failed check


def test_hf_bf16_export(tmp_path):
    from safetensors import safe_open

    cfg = tiny_config("gdn_mla")
    model = perturbed_model(cfg)
    x = tokens(cfg)
    export_model(model, cfg, tmp_path, fmt="hf", dtype="bf16")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(x).long()).logits.numpy()
    ours = logits(model, x)
    assert 1e-4 < np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 3e-2  # bf16 weight rounding, nothing more


def test_max_position_embeddings_is_what_the_model_can_run():
    """Recurrent mixers and plain RoPE compute any position (no limit); YaRN's limit is its extended context."""
    from hybrid_jax.export.hf import NO_POSITION_LIMIT, position_limit
    from tests.export.conftest import tiny_config

    assert position_limit(tiny_config("gdn").model) == NO_POSITION_LIMIT == 2**20  # no attention
    assert position_limit(tiny_config("mamba2_mla").model) == NO_POSITION_LIMIT  # MLA, plain RoPE
    assert position_limit(tiny_config("gdn_mla").model) == 16 * 4  # YaRN: original 16 x factor 4
