"""train.eval_tasks: lm-eval tasks scored during training on the live parameters (the scores equal an offline
evaluation of the checkpoint of the same step), logged to metrics.jsonl and TensorBoard; a failed evaluation is a
warning; bad task names and missing files are one line before anything is built."""

import json

import pytest

pytest.importorskip("lm_eval")

from hybrid_jax.train.config_checks import ConfigError  # noqa: E402
from hybrid_jax.train.loop import train  # noqa: E402
from hybrid_jax.train.report.task_evals import TaskEvals  # noqa: E402
from tests.data.util import sample_documents, tiny_hf_tokenizer  # noqa: E402
from tests.train.common import tiny_config  # noqa: E402


def _arc(i: int) -> dict:
    return {"id": str(i), "question": f"Which word {i} comes next?", "answerKey": "B",
            "choices": {"text": ["the cat", "a dog sat", "of the", "and then"], "label": ["A", "B", "C", "D"]}}


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    """A BPE tokenizer of 300 ids and ARC-Easy / PIQA files of four documents each, in the shared files' schemas."""
    tmp = tmp_path_factory.mktemp("tasks")
    tokenizer = tiny_hf_tokenizer(tmp, sample_documents(60, seed=1))
    data = tmp / "data"
    data.mkdir()
    for split in ("train", "validation", "test"):
        (data / f"ARC-Easy-{split}.jsonl").write_text("".join(json.dumps(_arc(i)) + "\n" for i in range(4)))
    piqa = [{"goal": f"To fold paper {i}", "sol1": "press it flat", "sol2": "burn it", "label": i % 2}
            for i in range(4)]
    (data / "piqa_validation_with_labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in piqa))
    return dict(tokenizer=tokenizer, data=data)


def _config(task_files, workdir, **train):
    c = tiny_config(str(workdir), **{**dict(steps=4, warmup_steps=1, log_every=2, save_every=4, eval_tasks=
                                            "arc_easy,piqa", eval_tasks_every=2, eval_tasks_limit=3,
                                            eval_tasks_data=str(task_files["data"])), **train})
    c.model.vocab_size = 320
    c.data.tokenizer = str(task_files["tokenizer"])
    return c


def test_tasks_are_scored_on_the_live_parameters_and_a_failure_is_a_warning(task_files, tmp_path, monkeypatch):
    real, calls = TaskEvals.__call__, []

    def first_fails(self, params):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the task data went away")
        return real(self, params)

    monkeypatch.setattr(TaskEvals, "__call__", first_fails)
    record = train(_config(task_files, tmp_path), log=lambda *_: None)
    assert record["step"] == 4 and len(calls) == 2  # step 2 failed, step 4 scored, the run went on
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (scored,) = [r for r in rows if "eval_seconds" in r]
    assert scored["step"] == 4 and scored["eval_seconds"] > 0
    assert set(scored) == {"step", "eval_seconds", "eval/arc_easy/acc", "eval/arc_easy/acc_norm", "eval/piqa/acc",
                           "eval/piqa/acc_norm"}
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]

    from hybrid_jax.eval import evaluate  # the checkpoint of step 4, loaded and scored offline: the same scores

    offline = evaluate(tasks=["arc_easy", "piqa"], workdir=tmp_path, step=4, limit=3, data_dir=task_files["data"])
    for task in ("arc_easy", "piqa"):
        for metric in ("acc", "acc_norm"):
            assert scored[f"eval/{task}/{metric}"] == pytest.approx(offline["results"][task][f"{metric},none"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("eval/piqa/acc")] == [4]


@pytest.mark.parametrize("overrides,message", [
    ({"eval_tasks": "arc_esay"}, r"train.eval_tasks=arc_esay: unknown task 'arc_esay': did you mean arc_easy\? the "
                                 r"bundled tasks are arc_challenge, arc_easy, hellaswag, piqa"),
    ({"eval_tasks": "arc_challenge"}, r"arc_challenge reads ARC-Challenge-train.jsonl, .* which is not there"),
    ({"eval_tasks_data": "/nowhere"}, r"the task data folder /nowhere does not exist"),
    ({"eval_tasks": "arc_easy, piqa"}, r"must be task names separated by commas, without spaces"),
])
def test_bad_task_evaluations_are_one_line_before_anything_is_built(task_files, tmp_path, overrides, message):
    from hybrid_jax.train.preflight import preflight

    with pytest.raises(ConfigError, match=message):
        preflight(_config(task_files, tmp_path / "run", **overrides))
    assert not (tmp_path / "run").exists()


def test_task_evaluations_need_a_tokenizer(task_files, tmp_path):
    from hybrid_jax.train.preflight import preflight

    config = _config(task_files, tmp_path / "run")
    config.data.tokenizer = ""
    with pytest.raises(ConfigError, match=r"train.eval_tasks=arc_easy,piqa needs the run's tokenizer"):
        preflight(config)
