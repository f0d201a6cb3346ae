"""End to end on CPU: a demo-config run directory (Llama-2 tokenizer), score ARC-Easy and PIQA
from the local files with the JAX model, export to HF, score the export with lm-eval's ``hf`` model: same scores."""

import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("torch")

from hybrid_jax.eval.lm import bucket_length  # noqa: E402
from tests.conftest import load_config  # noqa: E402

TASKS = "arc_easy,piqa"


@pytest.fixture(scope="module")
def run_dir(shared_data, tmp_path_factory):
    """A run directory (step-0 checkpoint) of the random-init demo model with the Llama-2 tokenizer; one metrics line
    stands in for training (the trainer's own tests cover training)."""
    from flax import nnx

    from hybrid_jax.export.tensors import flat_params
    from hybrid_jax.model import HybridLM
    from hybrid_jax.train.warm_start import write_workdir

    cfg = load_config("demo")
    cfg.model.update(dict(vocab_size=32000, pattern="*-G-", num_layers=4))  # MLA + GDN: fewer compiles than the demo
    cfg.data.tokenizer = str(shared_data / "tokenizers" / "llama2" / "tokenizer.model")
    cfg.train.update(dict(global_batch_size=8, micro_batch_size=1, seq_len=128))
    workdir = tmp_path_factory.mktemp("run")
    write_workdir(cfg, flat_params(HybridLM(cfg.model, rngs=nnx.Rngs(0))), workdir)
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 10.375}) + "\n")
    return workdir


def test_bucket_length():
    assert [bucket_length(n, 128) for n in (1, 32, 33, 100, 128, 500)] == [32, 32, 64, 128, 128, 128]


def test_eval_jax_and_hf_export_agree(run_dir, shared_data, capsys):
    from hybrid_jax.eval.__main__ import main as eval_main
    from hybrid_jax.export.__main__ import main as export_main

    data = str(shared_data / "eval")
    eval_main(["--workdir", str(run_dir), "--tasks", TASKS, "--limit", "8", "--batch-size", "4", "--data-dir", data])
    jax_record = json.loads((run_dir / "eval" / "step_0_jax.json").read_text())
    assert "arc_easy: acc" in capsys.readouterr().out

    export_dir = run_dir / "hf"
    export_main(["--workdir", str(run_dir), "--out", str(export_dir)])
    card = (export_dir / "README.md").read_text()
    assert "Final training loss: 10.3750 (step 0)" in card and "Steps: 0 of 300" in card
    assert (export_dir / "tokenizer.model").is_file()

    eval_main(["--hf", str(export_dir), "--tasks", TASKS, "--limit", "8", "--batch-size", "4", "--data-dir", data])
    hf_record = json.loads((export_dir / "eval_results.json").read_text())
    for task in TASKS.split(","):
        ours, theirs = jax_record["results"][task], hf_record["results"][task]
        for metric in ("acc,none", "acc_norm,none"):
            assert 0.0 <= ours[metric] <= 1.0
            np.testing.assert_allclose(theirs[metric], ours[metric], atol=1e-9, err_msg=f"{task} {metric}")


def test_loglikelihoods_match_hf(run_dir, shared_data):
    """Per-request log-likelihoods (and greedy flags), rolling log-likelihoods (one text longer than the 128-token
    window) and greedy generations of the JAX LM and lm-eval's HFLM on the export agree."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from hybrid_jax.eval.run import _jax_lm
    from hybrid_jax.export.writer import export

    export_dir = export(run_dir, run_dir / "hf_ll")
    with open(shared_data / "eval" / "ARC-Easy-validation.jsonl") as f:
        rows = [json.loads(next(f)) for _ in range(6)]
    requests = [Instance("loglikelihood", {}, (f"Question: {r['question']}\nAnswer:", f" {text}"), i)
                for r in rows for i, text in enumerate(r["choices"]["text"])]
    ours, _ = _jax_lm(run_dir, None, batch_size=4)
    theirs = HFLM(pretrained=str(export_dir), trust_remote_code=True, dtype="float32", device="cpu", batch_size=4,
                  max_length=128)  # the JAX LM's window (train.seq_len); the export itself has no position limit
    a, b = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], rtol=1e-5, atol=1e-4)
    assert [g for _, g in a] == [g for _, g in b]
    assert len({round(x, 3) for x, _ in a}) > len(a) // 2  # distinct scores, not a constant

    texts = [r["question"] for r in rows[:2]] + [" ".join(r["question"] for r in rows) * 3]  # the last > 128 tokens
    rolling = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]
    np.testing.assert_allclose(ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling), rtol=1e-5)

    generate = [Instance("generate_until", {}, (f"Question: {rows[0]['question']}\nAnswer:",
                                                {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": False}), 0)]
    assert ours.generate_until(generate) == theirs.generate_until(generate)

    # what `eval --hf` gets: max_length from the export (MLA with plain RoPE and GDN: no limit), so a continuation
    # longer than the training seq_len (here ~300 tokens > 128) is scored instead of failing lm-eval's assertion
    assert json.loads((export_dir / "config.json").read_text())["max_position_embeddings"] == 2**20
    default = HFLM(pretrained=str(export_dir), trust_remote_code=True, dtype="float32", device="cpu", batch_size=1)
    long = Instance("loglikelihood", {}, ("Question: why?\nAnswer:", " " + texts[-1]), 0)
    (score, _), = default.loglikelihood([long])
    assert np.isfinite(score) and score < -100


def test_write_tasks_for_the_lm_eval_cli(tmp_path, capsys):
    from hybrid_jax.eval.__main__ import main as eval_main

    data = tmp_path / "data"
    data.mkdir()
    eval_main(["--write-tasks", str(tmp_path / "tasks"), "--data-dir", str(data)])
    written = sorted(p.name for p in (tmp_path / "tasks").glob("*.yaml"))
    assert written == ["arc_challenge.yaml", "arc_easy.yaml", "hellaswag.yaml", "piqa.yaml"]
    text = (tmp_path / "tasks" / "arc_easy.yaml").read_text()
    assert str(data.resolve()) in text and "${DATA_DIR}" not in text
    assert f"lm_eval --model hf --model_args pretrained=EXPORT_DIR,trust_remote_code=True,dtype=float32 " \
           f"--include_path {tmp_path / 'tasks'}" in capsys.readouterr().out
