"""benchmarks/train_ab.py: trees alternate round by round, each run in its own tree; one record with the ratios."""

import json
import os

import pytest

from benchmarks import record, train_ab


def _tree(tmp_path, name):
    tree = tmp_path / name
    (tree / "configs").mkdir(parents=True)
    (tree / "configs" / "c.py").write_text("")
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "train_throughput.py").write_text("")
    return tree


def test_trees_alternate_and_the_record_holds_each_over_the_first(tmp_path, monkeypatch, capsys):
    before, after = _tree(tmp_path, "before"), _tree(tmp_path, "after")
    speeds = {"before": iter([100.0, 104.0]), "after": iter([110.0, 112.0])}
    calls = []

    def fake_run(cmd, tree, timeout):
        name = cmd[cmd.index("--name") + 1]
        env = train_ab.tree_env(tree)
        calls.append((name, tree.path, env["BENCH_COMMIT"], env["PYTHONPATH"].split(os.pathsep)[0], cmd[-1]))
        if name == "after_2":
            return 1  # a failed run: named, the others stay
        record.save(name, dict(tokens_per_s=next(speeds[tree.name]), mfu=0.5, peak_memory_gib=40.0, loss_last=11.9),
                    out=cmd[cmd.index("--out") + 1])
        return 0

    monkeypatch.setattr(train_ab, "run_train", fake_run)
    train_ab.main(["--config", "configs/c.py", "--tree", f"before={before}@abc1234", "--tree", f"after={after}@def5678",
                   "--out", str(tmp_path / "out"), "--", "--config.train.micro_batch_size=16"])
    assert [c[0] for c in calls] == ["before_1", "after_1", "before_2", "after_2"]
    assert calls[0][1:] == (before, "abc1234", str(before), "--config.train.micro_batch_size=16")
    assert calls[1][1:4] == (after, "def5678", str(after))
    figures = json.loads((tmp_path / "out" / "train_ab_c.json").read_text())["figures"]
    assert figures["before"]["tokens_per_s"] == [100.0, 104.0] and figures["before"]["median_tokens_per_s"] == 102.0
    assert figures["after"]["tokens_per_s"] == [110.0] and figures["after"]["over_first"] == pytest.approx(110 / 102)
    assert figures["failed"] == {"after_2": "failed: 1"}
    assert "after: 110 tokens/s (1.078x before)" in capsys.readouterr().out


def test_bad_trees_are_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(train_ab, "run_train", lambda *a: pytest.fail("ran"))
    tree = _tree(tmp_path, "t")
    for trees in (["--tree", f"a={tree}"], ["--tree", f"a={tree}", "--tree", f"a={tree}"],
                  ["--tree", f"a={tree}", "--tree", f"b={tmp_path / 'missing'}"], ["--tree", "a", "--tree", "b=x"]):
        with pytest.raises(SystemExit):
            train_ab.main(["--config", "configs/c.py", *trees, "--out", str(tmp_path / "out")])
