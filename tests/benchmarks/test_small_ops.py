"""benchmarks small_ops on CPU (--smoke): the op selection and the short conv's kernel-over-XLA ratios in its record."""

from __future__ import annotations

import json

import pytest

from benchmarks import small_ops


def test_the_conv_ops_alone_give_their_ratio(tmp_path, capsys):
    small_ops.main(["--smoke", "--only", "mamba2_conv", "mamba2_conv_xla", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "mamba2_conv: with its Pallas kernels over XLA's: forward" in out and "silu_mul share" not in out
    (path,) = tmp_path.glob("*small_ops*.json")
    figures = json.loads(path.read_text())["figures"]
    assert [r["op"] for r in figures["ops"]] == ["mamba2_conv", "mamba2_conv_xla"]
    ops = {r["op"]: r for r in figures["ops"]}
    assert ops["mamba2_conv"]["fwdbwd_bytes"] == ops["mamba2_conv_xla"]["fwdbwd_bytes"] > 0
    assert figures["kernel_over_xla"] == {"mamba2_conv": {p: pytest.approx(
        ops["mamba2_conv"][f"{p}_ms"] / ops["mamba2_conv_xla"][f"{p}_ms"]) for p in ("fwd", "fwdbwd")}}


def test_an_unknown_op_is_refused_with_the_names():
    with pytest.raises(SystemExit, match="no op short_cnov; the ops: rmsnorm, .*short_conv, short_conv_xla"):
        small_ops.main(["--smoke", "--only", "short_cnov"])
