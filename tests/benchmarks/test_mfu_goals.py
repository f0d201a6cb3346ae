"""benchmarks/mfu_goals.py: the figures' train commands and the one record built from their train records."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import mfu_goals, record


def _train_record(directory, name, tokens_per_s, mfu, **more):
    record.save(f"mfu_{name}", dict(tokens_per_s=tokens_per_s, mfu=mfu, peak_memory_gib=40.0, micro_batch_size=32,
                                    seq_len=2048, remat="none", **more), out=directory)


def test_the_record_holds_each_figure_against_its_goal_and_names_what_is_missing(tmp_path, capsys):
    runs = tmp_path / "runs"
    _train_record(runs, "300m_gdn_mock", 266_000.0, 0.502)
    _train_record(runs, "300m_gdn_fineweb", 262_000.0, 0.494)
    _train_record(runs, "1b_gdn", 70_000.0, 0.51, step_s_halves=[0.47, 0.46])
    mfu_goals.main(["--collect", str(runs), "--only", "300m_gdn_mock", "300m_gdn_fineweb", "1b_gdn", "3b_8192",
                    "--out", str(tmp_path / "out")])
    figures = json.loads((tmp_path / "out" / "mfu_goals.json").read_text())["figures"]
    assert figures["300m_gdn_mock"] == dict(mfu=0.502, tokens_per_s=266_000.0, peak_memory_gib=40.0,
                                            micro_batch_size=32, seq_len=2048, remat="none", goal=0.50, met=True)
    assert not figures["300m_gdn_fineweb"]["met"] and not figures["1b_gdn"]["met"]
    assert figures["1b_gdn"]["step_s_halves"] == [0.47, 0.46]
    assert figures["fineweb_over_mock"]["ratio"] == pytest.approx(262 / 266) and not figures["fineweb_over_mock"]["met"]
    assert figures["not_measured"] == {"3b_8192": "no record mfu_3b_8192.json"}
    out = capsys.readouterr().out
    assert "300m_gdn_mock: 266,000 tokens/s, MFU 50.2% (goal 50%: met)" in out
    assert "1b_gdn: 70,000 tokens/s, MFU 51.0% (goal 57%: NOT met)" in out


def test_train_commands_and_bad_input(tmp_path):
    args = SimpleNamespace(fineweb="FW3", steps=10, warmup=2, micro_batch_3b=2, remat_3b="dots")
    fineweb = mfu_goals.train_command("300m_gdn_fineweb", args, tmp_path)
    assert fineweb[2:4] == ["benchmarks", "train"] and fineweb[-2:] == ["--config.data.source=tokens",
                                                                         "--config.data.path=FW3"]
    assert mfu_goals.train_command("3b_8192", args, tmp_path)[-3:] == [
        "--config.train.seq_len=8192", "--config.train.micro_batch_size=2", "--config.model.remat=dots"]
    default = SimpleNamespace(fineweb=None, steps=10, warmup=2, micro_batch_3b=None, remat_3b=None)
    assert mfu_goals.train_command("3b_8192", default, tmp_path)[-1] == "--config.train.seq_len=8192"
    with pytest.raises(SystemExit):
        mfu_goals.main(["--fineweb", str(tmp_path / "none")])
    with pytest.raises(SystemExit):
        mfu_goals.main(["--collect", str(tmp_path / "none")])
