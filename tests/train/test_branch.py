"""train.branch_from: a new workdir continues another run's checkpoint exactly (state and data position), with its
own config and checkpoints, and leaves the source untouched."""

import json

import numpy as np
import pytest

from hybrid_jax.checkpoints import NoUsableCheckpoint, read_config
from hybrid_jax.train.loop import train
from tests.train.common import run_config


def _files(workdir) -> dict[str, float]:
    return {str(p.relative_to(workdir)): p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}


def test_a_branch_continues_the_source_checkpoint_exactly(finished_run, tmp_path):
    before = _files(finished_run)
    branch = tmp_path / "branch"
    lines: list[str] = []
    config = run_config(branch, branch_from=f"{finished_run}:15", save_every=100)
    record = train(config, log=lambda *a: lines.append(" ".join(map(str, a))))
    source = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 20  # steps 16..20 again, from step 15's state and data position: the same losses
    np.testing.assert_allclose(record["loss"], source[-1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(record["grad_norm"], source[-1]["grad_norm"], rtol=1e-5)
    assert any(line.startswith(f"branching from {finished_run} step 15") for line in lines), lines
    assert json.loads((branch / "branched_from.json").read_text())["step"] == 15
    assert read_config(branch).train.branch_from == f"{finished_run}:15"
    assert [p.name for p in (branch / "checkpoints").iterdir()] == ["20"]
    assert _files(finished_run) == before  # nothing written, moved or copied in the source

    lines.clear()  # relaunched: the branch has a checkpoint of its own and resumes from it
    train(config, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any("train.branch_from=" in line and "is not used" in line for line in lines), lines


@pytest.mark.parametrize("spec,message", [
    ("{run}:12", r"train.branch_from=.*:12: .* has no checkpoint at step 12 \(it has \[10, 15, 20\]\)"),
    ("{tmp}/none", r"train.branch_from=.*none: .*checkpoints holds no complete checkpoint"),
    ("{branch}", r"train.branch_from=.* is this run's own workdir; .*train.restore_step"),
])
def test_a_bad_branch_is_one_line_and_creates_nothing(finished_run, tmp_path, spec, message):
    branch = tmp_path / "branch"
    config = run_config(branch, branch_from=spec.format(run=finished_run, tmp=tmp_path, branch=branch))
    with pytest.raises(NoUsableCheckpoint, match=message):
        train(config, log=lambda *_: None)
    assert not branch.exists()
