"""benchmarks/context_shard.py at tiny shapes on CPU (XLA impl): the record holds, per op, the plain and the shard
times, their ratios, for MLA one time per shard offset, and with --accuracy each recurrence's error in shards."""

import json

import pytest

from benchmarks import context_shard


def test_context_shard_record_at_tiny_shapes(tmp_path):
    context_shard.main(["--smoke", "--impl", "xla", "--seq", "64", "--shards", "2", "--repeats", "1", "--only", "gla",
                        "gdn", "attention", "--accuracy", "--out", str(tmp_path)])
    figures = json.loads((tmp_path / "context_shard.json").read_text())["figures"]
    assert (figures["seq"], figures["shards"], figures["impl"]) == (64, 2, "xla")
    results = figures["results"]
    assert sorted(r["op"] for r in results.values()) == ["attention", "gdn", "gla"]
    gla = results["gla (zebra_1b_mamba2_hybrid)"]
    assert gla["shape"] == "B1 T32 H1/2 K16 V16 bfloat16" and gla["goal"] == 1.25
    for r in (gla, results["gdn (zebra_1b_gdn_hybrid)"]):
        for what in ("fwd", "fwdbwd"):
            assert r[f"ratio_{what}"] == pytest.approx(r[f"shard_{what}_ms"] / r[f"plain_{what}_ms"])
        assert r["within_goal"] == (max(r["ratio_fwd"], r["ratio_fwdbwd"]) <= 1.25)
    for r in (gla, results["gdn (zebra_1b_gdn_hybrid)"]):  # bf16 inputs: the shards as close as the plain kernel
        a = r["accuracy"]
        assert a["seq"] == 64 and 0 < a["plain_vs_f32"] < 2e-2 and 0 < a["shards_vs_f32"] < 1.5 * a["plain_vs_f32"]
    mla = results["attention (zebra_1b_kda_hybrid_64k)"]
    assert "accuracy" not in mla
    assert mla["keys"] == 64 and len(mla["shard_fwd_ms"]) == len(mla["shard_fwdbwd_ms"]) == 2
    assert mla["ratio_max_fwdbwd"] == pytest.approx(max(mla["shard_fwdbwd_ms"]) / mla["plain_fwdbwd_ms"])
    assert min(mla["shard_fwd_ms"] + mla["shard_fwdbwd_ms"] + [gla["plain_fwd_ms"], gla["shard_fwdbwd_ms"]]) > 0


def test_the_shard_problems_are_the_recipes():
    """One shard of 65536 tokens over 8: the 64k recipe's KDA and MLA, the 1B GDN and Mamba2 recipes' heads."""
    shapes = {p.op: (p.B, p.T, p.H, p.HV, p.K, p.V, p.scale) for p in context_shard.problems(65536, 8)}
    assert shapes == {"kda": (1, 8192, 16, 32, 128, 128, None), "attention": (1, 8192, 32, 32, 64, 64, None),
                      "gdn": (1, 8192, 8, 16, 64, 64, None), "gla": (1, 8192, 8, 32, 64, 64, 1.0)}
