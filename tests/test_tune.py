"""``python -m hybrid_jax.tune`` on CPU (interpret mode, tiny shapes): the tuning file it writes, a candidate that does
not compile, and the one-line errors on bad input."""

import json
import time

import pytest

from hybrid_jax.kernels import tuning_file
from hybrid_jax.kernels.recurrent.search import STAGES, Axis
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.sweep import Search, sweep
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig
from hybrid_jax.tune.cli import main
from tests.conftest import REPO

DEMO = str(REPO / "configs" / "demo.py")


def test_tune_demo_writes_a_tuning_file_with_every_op_it_uses(tmp_path, capsys):
    out = tmp_path / "tuning.json"
    assert main(["--config", DEMO, "--budget-s", "2", "--out", str(out), "--interpret", "--repeats", "1"]) == out
    tf = tuning_file.read(out)
    assert tuning_file.stale_reason(tf) is None
    assert set(tf.recurrent) == {("gdn", 16, 16), ("kda", 16, 32), ("gla", 16, 16)}  # GDN, KDA and Mamba2's SSD
    data = json.loads(out.read_text())
    assert all(e["tuned_ms"] <= e["builtin_ms"] for e in data["recurrent"])
    assert data["budget_s"] == 2 and {s["op"] for s in data["shapes"]} == {"gdn", "kda", "gla"}
    assert all(s["configs"] == ["demo"] and s["chunk"] == 16 for s in data["shapes"])
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "built-in ms" in text


def test_a_candidate_that_fails_to_compile_is_skipped_with_a_note(monkeypatch):
    search = Search([Problem("gla", 1, 64, 1, 2, 16, 16, "float32")], RecurrentConfig(chunk=16), interpret=True,
                    repeats=2)
    state_fwd = STAGES["state"]

    def state_or_overflow(static, *args):
        if static.cfg.state == Launch(2, 1):
            raise RuntimeError("out of resources: shared memory, required 300000, hardware limit 232448")
        return state_fwd(static, *args)

    monkeypatch.setitem(STAGES, "state", state_or_overflow)
    notes = []
    axis = Axis("state", (Launch(4, 1), Launch(2, 1), Launch(8, 2)), ("state",))
    best = sweep(search, time.perf_counter() + 120, notes.append, axes=[axis])
    assert best.state != Launch(2, 1)
    skipped = [n for n in notes if "skipped" in n]
    assert len(skipped) == 1 and skipped[0].startswith(
        "state=Launch(num_warps=2, num_stages=1): skipped, out of shared memory (RuntimeError: out of resources")


@pytest.mark.parametrize("argv, error", [
    (["--config", "configs/none.py"], "--config configs/none.py: no such file"),
    (["--config", DEMO, "--budget-s", "0"], "--budget-s must be positive, got 0"),
    (["--config", DEMO, "--out", "{file}/tuning.json", "--interpret"], "cannot be written"),
    (["--config", DEMO, "--out", "{dir}", "--interpret"], "is a folder"),
    (["--config", DEMO], "the Pallas kernels do not run on cpu (training there uses their XLA form): nothing to tune, "
                         "nothing written"),  # issue 49 item 3: it claimed a speed-up and wrote the cache's file
    (["--config", DEMO, "--interpret"], "--interpret needs --out FILE"),
])
def test_bad_input_is_one_line_before_anything_is_compiled(tmp_path, argv, error):
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file", dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value).startswith("python -m hybrid_jax.tune: error: ") and error in str(e.value)
    assert "\n" not in str(e.value)
    assert not tuning_file.cache_path().exists()
