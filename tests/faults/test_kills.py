"""The kill -9 and signal cases that hold, kept held: a SIGKILL in the middle of a save resumes exactly (each step's
metrics once), and Ctrl-C saves the step it stopped at and the rerun resumes exactly."""

import json
import os
import signal
import subprocess
import time

import pytest

from hybrid_jax.checkpoints import latest_step
from hybrid_jax.train.loop import train
from tests.conftest import REPO
from tests.faults.conftest import run_config
from tests.train.test_cli import _command


def _records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_resume_after_sigkill_during_a_save(tmp_path):
    cmd = _command(tmp_path, **{"train.steps": 20, "train.save_every": 1, "train.log_every": 1})
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    checkpoints, tmp_seen = tmp_path / "checkpoints", None
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        entries = list(checkpoints.iterdir()) if checkpoints.is_dir() else []
        complete = [p for p in entries if p.name.isdigit()]
        partial = [p.name for p in entries if not p.name.isdigit() and "tmp" in p.name]
        if len(complete) >= 2 and partial:
            proc.send_signal(signal.SIGKILL)
            tmp_seen = partial
            break
        time.sleep(0.002)
    proc.wait()
    log.close()
    assert tmp_seen, f"never saw a save in progress; rc={proc.returncode}"
    assert proc.returncode == -signal.SIGKILL
    before = {r["step"]: r["loss"] for r in _records(tmp_path)}  # what the killed run logged
    killed_at = max(before)
    assert killed_at < 20

    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed_from = int(out.stdout.split("resuming from")[1].split("step")[1].split()[0])
    assert resumed_from < killed_at  # it redid steps that the killed run had already logged

    after = _records(tmp_path)
    assert [r["step"] for r in after] == list(range(1, 21))  # the redone steps' old rows were dropped: each once
    redone = {r["step"]: r["loss"] for r in after if resumed_from < r["step"] <= killed_at}
    assert redone and min(redone) == resumed_from + 1
    for step, again in redone.items():
        assert again == pytest.approx(before[step], rel=1e-6), step  # the redone steps match the killed run's


def test_sigint_mid_run_saves_the_step_and_the_rerun_resumes_exactly(finished_run, tmp_path):
    import threading

    from hybrid_jax.train.stops import Interrupted, StopRequests

    def interrupt_once_armed():  # SIGINT as soon as the trainer's handler is installed (it is compiling step 1)
        while getattr(signal.getsignal(signal.SIGINT), "__self__", None).__class__ is not StopRequests:
            threading.Event().wait(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    config = run_config(tmp_path)  # save_every 5: a checkpoint at step 1 can only be the interrupt's
    handler = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_once_armed, daemon=True).start()
    with pytest.raises(Interrupted) as e:
        train(config, log=lambda *_: None)
    assert (e.value.step, e.value.exit_status) == (1, 130)
    assert str(e.value) == (f"SIGINT: interrupted at step 1; checkpoint saved in {tmp_path}; rerun the same command "
                            "to resume")
    assert latest_step(tmp_path) == 1
    assert signal.getsignal(signal.SIGINT) is handler  # the previous handler is back

    resumed = train(config, log=lambda *_: None)
    assert resumed["step"] == 20
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 5, 10, 15, 20]  # the step it stopped at is logged, then every step once
    losses = _losses(tmp_path)
    assert {s: losses[s] for s in (5, 10, 15, 20)} == pytest.approx(_losses(finished_run), rel=1e-6)


def _losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def test_ctrl_c_is_answered_at_once_inside_a_long_compile_and_twice_aborts(tmp_path):
    """Issue 49 item 2: Ctrl-C during a long native call (building the model, compiling) was ignored with no
    message; the first one is now answered at once and the second aborts at once."""
    proc = subprocess.Popen(_command(tmp_path, **{"train.steps": 5}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    for line in proc.stdout:
        if line.startswith("compiling the train step"):
            break
    proc.send_signal(signal.SIGINT)
    said = proc.stderr.readline() + proc.stderr.readline()
    assert "SIGINT: finishing the step in flight and saving a checkpoint (press Ctrl-C again" in said, said
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert time.perf_counter() - start < 10
    assert "SIGINT again: aborting without saving" in proc.stderr.read()
