"""benchmarks/record.py: a record has every key of the schema and reads back as it was written."""

import json

import numpy as np
import pytest

from benchmarks import record


def test_save_writes_every_key_and_load_reads_it_back(tmp_path, monkeypatch):
    monkeypatch.setattr(record.sys, "argv", ["/tree/benchmarks/__main__.py", "kernels", "--only", "gdn_anchor"])
    figures = {"gdn_anchor": {"fwd_ms": np.float32(0.5), "fwd_bwd_ms": 2.5, "shape": (8, 2048)}}
    path = record.save("kernels", figures, out=tmp_path)
    assert path == tmp_path / "kernels.json"
    saved = record.load(path)
    assert tuple(saved) == record.KEYS
    assert saved["name"] == "kernels"
    assert saved["command"] == "python -m benchmarks kernels --only gdn_anchor"
    assert saved["figures"] == {"gdn_anchor": {"fwd_ms": 0.5, "fwd_bwd_ms": 2.5, "shape": [8, 2048]}}
    assert saved["gpu"] == {"device_kind": "cpu", "platform": "cpu"}
    assert saved["versions"]["jax"] and saved["versions"]["jaxlib"]
    assert saved["date"].endswith("+00:00")
    assert isinstance(saved["commit"], str) and saved["dirty"] in (True, False, None)


def test_save_to_a_file_and_to_out_by_default(tmp_path, monkeypatch):
    assert record.save("a", {"x": 1}, out=tmp_path / "sub" / "b.json") == tmp_path / "sub" / "b.json"
    assert record.out_dir(tmp_path / "sub" / "b.json") == tmp_path / "sub"  # side files beside the record, not in it
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert record.load(record.save("c", {"x": 2}))["figures"] == {"x": 2}
    assert (tmp_path / "out" / "c.json").is_file()


def test_commit_from_the_environment_first_then_git(monkeypatch, tmp_path):
    monkeypatch.setenv("BENCH_COMMIT", "abc123")
    assert record.commit() == ("abc123", None)  # over the checkout's own git (a copy may carry another commit's)
    monkeypatch.delenv("BENCH_COMMIT")
    head, _ = record.commit()
    assert len(head) == 40 or head == "unknown"
    monkeypatch.setattr(record, "ROOT", tmp_path)  # not a git tree
    assert record.commit() == ("unknown", None)
    monkeypatch.setattr(record, "ROOT", record.pathlib.Path(__file__).parent)  # a folder inside a checkout: not its
    assert record.commit() == ("unknown", None)  # commit (an unpacked archive of another one may sit there)


def test_command_of_a_part_module_and_load_refuses_other_json(tmp_path):
    assert record.command(["/x/benchmarks/decode.py", "--batch", "1"]) == "python -m benchmarks decode --batch 1"
    (tmp_path / "other.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a benchmark record"):
        record.load(tmp_path / "other.json")
