"""Issue 47 item 3: ``eval --hf`` and ``generate --check --hf`` loaded any directory with ``trust_remote_code=True``:
two lines appended to an export's ``modeling_hybrid.py`` ran with no warning. Our exports now load with our own
modeling code; a directory's own code runs only when asked (``--trust-remote-code``)."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax import generate  # noqa: E402
from hybrid_jax.export.hf_load import RemoteCodeRefused, load_export  # noqa: E402
from hybrid_jax.export.writer import export_model  # noqa: E402
from tests.export.conftest import logits, perturbed_model, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    """An export of a tiny GDN model whose modeling file, when imported, writes a marker file."""
    cfg = tiny_config("gdn")
    model = perturbed_model(cfg)
    out = tmp_path_factory.mktemp("export")
    export_model(model, cfg, out, fmt="hf")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # item 13: it was 0600 beside 0644
    marker = out / "ran"
    with open(out / "modeling_hybrid.py", "a") as f:
        f.write(f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('the directory ran its own code')\n")
    return out, marker, model, cfg


def test_our_export_loads_with_our_code_and_never_runs_the_directorys(tampered):
    out, marker, model, cfg = tampered
    notes = []
    hf = load_export(out, note=notes.append)
    assert not marker.exists()
    assert notes == [f"note: {out / 'modeling_hybrid.py'} differs from this version's modeling code; loading with "
                     "this version's (--trust-remote-code runs the directory's instead)"]
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, 9), dtype=np.int32)
    import torch

    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, logits(model, tokens), rtol=2e-4, atol=2e-4)
    generate.hf_logits_fn(str(out))  # what `generate --check --hf` loads
    assert not marker.exists()


def test_foreign_code_runs_only_when_asked(tampered, tmp_path):
    out, marker, _, _ = tampered
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "someone_elses", "auto_map": {
        "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    with pytest.raises(RemoteCodeRefused, match=r"asks to run its own Python code \(modeling_x.XForCausalLM\); it "
                                                r"is not one of our exports: pass --trust-remote-code"):
        load_export(foreign)
    load_export(out, trust_remote_code=True)  # the user's choice: the directory's code runs
    assert marker.read_text() == "the directory ran its own code"
