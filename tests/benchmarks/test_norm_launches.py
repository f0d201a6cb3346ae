"""benchmarks norm_launches on CPU (--smoke, interpret mode): every launch checked against XLA, then timed."""

from __future__ import annotations

import json

import pytest

from benchmarks import norm_launches


def test_each_launch_is_checked_against_xla_and_timed_beside_the_current_one(tmp_path, monkeypatch):
    norm_launches.main(["--smoke", "--warps", "4", "--blocks", "256", "--programs", "2", "--out", str(tmp_path)])
    figures = json.loads((tmp_path / "norm_launches.json").read_text())["figures"]
    ops = ["add_rms_norm", "gdn_gated_norm", "mamba2_gated_norm"]
    assert [r["op"] for r in figures["launches"]] == [op for op in ops for _ in range(2)]
    assert [r["launch"] for r in figures["launches"]] == ["w4 b2048 p1024", "w4 b256 p2"] * 3
    assert figures["current"] == "w4 b2048 p1024" and set(figures["best"]) == set(ops)
    for r in figures["launches"]:
        assert 0 <= r["error"] < norm_launches.TOLERANCE and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
        if r["launch"] == figures["current"]:
            assert r["fwd_over_current"] == r["fwdbwd_over_current"] == 1.0
    # the bf16 outputs differ from XLA's by their rounding: with no tolerance the first launch is refused
    monkeypatch.setattr(norm_launches, "TOLERANCE", 0.0)
    with pytest.raises(ValueError, match="add_rms_norm at w4 b2048 p1024 differs from XLA"):
        norm_launches.main(["--smoke", "--warps", "4", "--blocks", "256", "--programs", "2", "--out", str(tmp_path)])
