"""benchmarks/loss_parity.py's reuse of a saved reference curve: the initial weights' digest tells weights apart, and
a saved curve is only accepted for the same settings and weights."""

import numpy as np
import pytest
from safetensors.numpy import save_file

from benchmarks.loss_parity import saved_reference, weights_digest


def test_weights_digest_tells_weights_apart(tmp_path):
    weights = {"embed": np.arange(12, dtype=np.float32).reshape(3, 4), "norm": np.ones(4, np.float32)}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    save_file(weights, tmp_path / "a" / "model.safetensors")
    save_file(dict(weights), tmp_path / "b" / "model.safetensors")
    weights["norm"][2] = np.nextafter(np.float32(1), np.float32(2))  # one ulp in one weight
    save_file(weights, tmp_path / "c" / "model.safetensors")
    assert weights_digest(tmp_path / "a") == weights_digest(tmp_path / "b")
    assert weights_digest(tmp_path / "a") != weights_digest(tmp_path / "c")


SETTINGS = dict(config="zebra_300m_gdn", reference="fla", steps=3, batch=8, seq_len=2048, data="mock",
                init_digest="ab12")


def test_saved_reference_is_reused_for_the_same_run():
    saved = dict(SETTINGS, guard_check=None, reference_wall_s=12.5, reference_losses=[11.9, 11.8, 11.7])
    assert saved_reference(saved, SETTINGS, "ref.json") == ([11.9, 11.8, 11.7], 12.5)


@pytest.mark.parametrize("field, value", [("batch", 4), ("init_digest", "cd34"), ("data", "tokens")])
def test_saved_reference_from_another_run_is_refused(field, value):
    saved = dict(SETTINGS, reference_wall_s=1.0, reference_losses=[1.0, 1.0, 1.0], **{field: value})
    with pytest.raises(SystemExit, match=f"another run.*{field}"):
        saved_reference(saved, SETTINGS, "ref.json")


def test_saved_reference_cut_short_is_refused():
    saved = dict(SETTINGS, reference_wall_s=1.0, reference_losses=[1.0, 1.0])
    with pytest.raises(SystemExit, match="2 losses for 3 steps"):
        saved_reference(saved, SETTINGS, "ref.json")
