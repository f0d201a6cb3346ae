"""``--from-hf``: our HF export back into a resumable step-0 workdir with bit-identical logits, tied or untied; a
directory that is not one of our exports is refused in one line before anything is read; the printed train command
holds only the model keys that differ from the base config."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from hybrid_jax.config import base_config  # noqa: E402
from hybrid_jax.export.__main__ import main, overrides  # noqa: E402
from hybrid_jax.export.writer import export_model  # noqa: E402
from tests.conftest import REPO, load_config  # noqa: E402
from tests.export.conftest import perturbed_model, tiny_config, tokens  # noqa: E402

DEMO = str(REPO / "configs" / "demo.py")


def test_hf_round_trip_is_identical(tmp_path, capsys):
    """A hybrid (MLA with YaRN, GDN) with an untied lm_head: export, the PyTorch model's logits, the CLI import into
    a workdir, the restored model's logits bit for bit."""
    from hybrid_jax.checkpoints import load
    from hybrid_jax.export.hf_load import load_export

    cfg = tiny_config("gdn_mla")
    cfg.model.update(dict(pattern="*-M-M-", tie_embeddings=False))  # the plan as the import writes it
    model = perturbed_model(cfg)
    x = tokens(cfg)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    ours = np.asarray(forward(state, x))
    export_model(model, cfg, tmp_path / "hf", fmt="hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    with torch.no_grad():  # the modeling file's own lm_head makes its logits
        theirs = load_export(tmp_path / "hf", note=lambda _: None)(torch.from_numpy(x).long()).logits.numpy()
    assert np.abs(theirs - ours).max() <= 1e-4

    main(["--from-hf", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run"), "--config", DEMO])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"imported {tmp_path / 'hf'} into {tmp_path / 'run'} (step 0). Train from it with:"
    assert printed[1].split() == ["python", "-m", "hybrid_jax.train", "--config", DEMO,
                                  f"--config.train.workdir={tmp_path / 'run'}",  # then what differs from demo.py:
                                  "--config.model.mla.mscale_all_dim=0.7",
                                  "--config.model.mla.original_max_position_embeddings=16",
                                  "--config.model.mla.rope_scaling_factor=4.0", "--config.model.num_layers=6",
                                  "--config.model.pattern='*-M-M-'", "--config.model.tie_embeddings=False",
                                  "--config.model.vocab_size=97"]
    loaded, imported = load(tmp_path / "run", step=0)
    assert imported.model.to_dict() == cfg.model.to_dict()
    loaded_graphdef, loaded_state = nnx.split(loaded)
    assert loaded_graphdef == graphdef  # the same modules and static settings: one compiled forward serves both
    np.testing.assert_array_equal(np.asarray(forward(loaded_state, x)), ours)


def test_hf_tied_import_is_identical(tmp_path):
    """The tied demo model (every sublayer kind) read back: the same config, every parameter bit for bit."""
    from hybrid_jax.export.imports import load_hf
    from hybrid_jax.export.tensors import flat_params

    cfg = load_config("demo")
    model = perturbed_model(cfg)
    export_model(model, cfg, tmp_path, fmt="hf")
    imported, params = load_hf(tmp_path, base_config())
    assert imported.model.to_dict() == cfg.model.to_dict() | {  # what config.json does not record is the base's
        "name": "", "dtype": "bfloat16", "chunk_size": 0}
    before = flat_params(model)
    assert params.keys() == before.keys() and "lm_head" not in params
    for key in before:
        np.testing.assert_array_equal(params[key], before[key], err_msg=key)


def test_from_hf_refuses_what_is_not_our_export(tmp_path):
    """One line saying what to pass instead, nothing written; and --from-fla sends our exports to --from-hf."""
    cfg = tiny_config("gdn")
    export_model(perturbed_model(cfg), cfg, tmp_path / "fla", fmt="fla")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "empty").mkdir()
    cases = {"fla": r"is an FLA checkpoint \(model_type 'gated_deltanet'\): import it with --from-fla",
             "llama": r"is not a hybrid_jax HF export \(model_type 'llama'\): --from-hf reads a directory written by "
                      r"`python -m hybrid_jax.export --format hf`",
             "empty": "has no config.json: --from-hf reads a directory written by"}
    for name, message in cases.items():
        with pytest.raises(SystemExit, match=r"^error: .*" + message):
            main(["--from-hf", str(tmp_path / name), "--workdir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
    export_model(perturbed_model(cfg), cfg, tmp_path / "hf", fmt="hf")
    with pytest.raises(SystemExit, match="model_type 'hybrid_jax' is our own HF export: import it with --from-hf"):
        main(["--from-fla", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_overrides_are_the_model_keys_that_differ_for_the_sublayers_used():
    base = base_config().model
    cfg = load_config("zebra_300m_gdn").model  # pure GDN: its kda / mamba2 / mla keys are not used
    cfg.kda.num_key_heads, cfg.mla.num_heads, cfg.mamba2.expand = 3, 5, 7
    assert overrides(cfg, base) == ["--config.model.name=zebra_300m_gdn"]
    cfg.gdn.num_key_heads, cfg.pattern, cfg.num_layers = 2, "*-M-", 4
    assert overrides(cfg, base) == [
        "--config.model.gdn.num_key_heads=2", "--config.model.mla.num_heads=5", "--config.model.name=zebra_300m_gdn",
        "--config.model.num_layers=4", "--config.model.pattern='*-M-'"]
