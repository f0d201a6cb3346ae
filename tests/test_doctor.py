"""``python -m hybrid_jax.doctor`` on CPU (interpret mode, tiny shapes): every kernel of the demo checks out; a planted
numerics error or a kernel that does not lower fails the run with the fallback hint; bad input is one line."""

import json

import jax.numpy as jnp

from hybrid_jax import kernels
from hybrid_jax.doctor.cli import main
from tests.conftest import REPO

DEMO = str(REPO / "configs" / "demo.py")
HINT = "--config.model.kernel_impl=xla"


def test_doctor_demo_every_kernel_ok(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["--config", DEMO, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and not report["failures"]
    assert {r["op"] for r in report["kernels"]} == {"gdn", "kda", "gla", "attention"}  # MLA, GDN, KDA, Mamba2
    for r in report["kernels"]:
        assert r["ok"] and r["lowers"] and r["runs"] and r["impl"] == "pallas_interpret", r
        want = {"o", "dq", "dk", "dv"} | ({"final_state", "dg", "dinitial_state"} if r["op"] != "attention" else set())
        want |= {"dbeta"} if r["op"] in ("gdn", "kda") else set()
        assert set(r["errors_xla"]) == set(r["errors_naive"]) == want, r["op"]
        assert max(r["errors_xla"].values()) <= 1e-4 and "T37" in r["shape"]
    env = report["environment"]
    assert env["platform"] == "cpu" and env["table"] == "no table: fallback" and env["versions"]["jax"]
    assert "fallback" in env["tuning"] and report["train_steps"] == []
    text = capsys.readouterr().out
    assert "all 4 kernel checks passed" in text and "training step skipped" in text
    lines = {line.strip(" │┃") for line in text.splitlines()}  # a pipe gets the table at its natural width
    for r in report["kernels"]:
        assert any(r["kernel"] in line and r["shape"] in line and ", ".join(r["configs"]) in line for line in lines), r
    assert "…" not in text


def test_doctor_planted_numerics_error_fails_with_the_fallback(monkeypatch, capsys, tmp_path):
    ssd = kernels.chunk_simple_gla

    def off_by_one_percent(*args, impl="auto", **kw):
        o, state = ssd(*args, impl=impl, **kw)
        return (o * 1.01 if impl.startswith("pallas") else o), state

    monkeypatch.setattr(kernels, "chunk_simple_gla", off_by_one_percent)
    out = tmp_path / "doctor.json"
    assert main(["--config", DEMO, "--kernels", "gla", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAILED gla H2/4 K16 V16 (pallas_interpret, demo): vs the float32 XLA form" in text
    assert "o 1.0e-02 > 0.0001" in text and HINT in text
    report = json.loads(out.read_text())
    assert not report["ok"] and [r["ok"] for r in report["kernels"]] == [False]


def test_doctor_a_kernel_that_does_not_lower(monkeypatch, capsys):
    def broken(q, *args, impl="auto", **kw):
        if impl.startswith("pallas"):
            raise NotImplementedError("no lowering for this op")
        return jnp.zeros_like(q), None

    monkeypatch.setattr(kernels, "chunk_gated_delta_rule", broken)
    assert main(["--config", DEMO, "--kernels", "gdn"]) == 1
    text = capsys.readouterr().out
    assert "does not lower: NotImplementedError: no lowering for this op" in text and HINT in text


def test_doctor_bad_input_is_one_line(capsys, tmp_path):
    assert main(["--config", DEMO, "--kernels", "gdn,flash"]) == 2
    assert "--kernels: unknown ['flash']" in capsys.readouterr().out
    assert main(["--config", str(tmp_path / "nope.py")]) == 2
    assert "no such file" in capsys.readouterr().out


def test_doctor_train_step_halves_the_micro_batch_until_it_fits(monkeypatch):
    from hybrid_jax.doctor import train_step as ts
    from tests.conftest import load_config

    def measure(config, *, steps, warmup):
        if config.train.micro_batch_size > 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
        return dict(step_s=0.1, tokens_per_s=1.0, mfu=None, peak_memory_gib=None, warmup_s=0.0, loss=1.0,
                    finite=True)

    monkeypatch.setattr(ts, "_measure", measure)
    monkeypatch.setattr(ts.jax, "clear_caches", lambda: None)  # keep the suite's compiled functions
    monkeypatch.setattr(ts.gc, "collect", lambda: 0)
    out = ts.train_step(load_config("demo"))  # micro batch 16
    assert out["ok"] and out["micro_batch_size"] == 4 and len(out["notes"]) == 2
    monkeypatch.setattr(ts, "_measure", lambda config, **kw: (_ for _ in ()).throw(ValueError("bad shape")))
    out = ts.train_step(load_config("demo"))
    assert not out["ok"] and out["micro_batch_size"] == 16 and "ValueError: bad shape" in out["error"]
