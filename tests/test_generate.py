"""``python -m hybrid_jax.generate``: a demo checkpoint sampled from, checked (and its HF export)."""

import io
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import generate
from tests.conftest import load_config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A step-0 workdir of the demo config (every sublayer kind) holding its initial weights, written as an import
    writes one (``write_workdir``): generation only reads a checkpoint, and training one is tested elsewhere."""
    from hybrid_jax.export.tensors import flat_params
    from hybrid_jax.model import HybridLM
    from hybrid_jax.train.warm_start import write_workdir

    config = load_config("demo")
    config.train.update(dict(global_batch_size=16, micro_batch_size=2, seq_len=32))
    model = HybridLM(config.model, rngs=nnx.Rngs(config.train.seed))
    path = tmp_path_factory.mktemp("demo_start")
    write_workdir(config, flat_params(model), path)
    return path


def test_prompt_ids_greedy_matches_full_forward(workdir, capsys):
    prompt = [5, 17, 3, 99]
    generate.main(["--workdir", str(workdir), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "6"])
    out = capsys.readouterr()
    ids = [int(x) for x in out.out.split()]
    assert len(ids) == 6 and "tokens/s decoding" in out.err
    model, _ = __import__("hybrid_jax").load(workdir)
    # teacher-forced over prompt + generated ids: each generated id is the argmax after its prefix
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray([prompt + ids[:-1]]))[0, len(prompt) - 1 :]
    assert ids == np.argmax(np.asarray(logits), axis=-1).tolist()


def test_text_prompt_without_tokenizer_is_refused(workdir):
    with pytest.raises(SystemExit, match="no tokenizer .* --prompt-ids"):
        generate.main(["--workdir", str(workdir), "--prompt", "hello"])


def test_chat_reads_turns_from_stdin(workdir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("1 2 3\n4,5\n"))
    generate.main(["--workdir", str(workdir), "--chat", "--max-new-tokens", "3", "--temperature", "1.0",
                   "--cache-len", "10"])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 3 for line in lines)
    assert "starting over" in out.err  # turn 2: 5 cached + 1 pending + 2 + 3 new > 10


def test_check_prints_loss_and_greedy(workdir, capsys):
    args = generate.parse_args(["--workdir", str(workdir), "--check", "--max-new-tokens", "5", "--check-docs", "2"])
    model, config = __import__("hybrid_jax").load(workdir)
    result = generate.check(model, config, generate.Codec(None), args)
    out = capsys.readouterr().out
    assert "mock data (no tokenizer)" in out and "validation loss over 2 documents" in out
    assert all(0 < x < math.log(config.model.vocab_size) + 1 for x in result["loss"])
    assert len(result["greedy"]) == 5


def test_check_with_a_tokenizer_needs_docs(workdir):
    model, config = __import__("hybrid_jax").load(workdir)
    args = generate.parse_args(["--workdir", str(workdir), "--check"])
    with pytest.raises(SystemExit, match="needs validation documents: give --docs FILE.jsonl"):
        generate.check(model, config, generate.Codec(object()), args)  # any tokenizer: refused before it is used


def test_check_of_hf_export_agrees(workdir, tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hybrid_jax.export.writer import export

    export(workdir, tmp_path / "hf")
    generate.main(["--workdir", str(workdir), "--check", "--hf", str(tmp_path / "hf"), "--max-new-tokens", "8",
                   "--check-docs", "2"])
    out = capsys.readouterr().out
    assert "(same tokens as the JAX model)" in out, out
    jax_loss, hf_loss = map(float, re.findall(r"validation loss (?:over \d+ documents: )?(\d+\.\d+)", out))
    assert abs(jax_loss - hf_loss) < 1e-4


def test_sampling():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 20000))
    assert (generate.sample(logits, jax.random.key(0), temperature=0.0, top_p=1.0) == 0).all()
    freq = np.bincount(np.asarray(generate.sample(logits, jax.random.key(1), temperature=1.0, top_p=1.0)),
                       minlength=4) / 20000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    nucleus = np.bincount(np.asarray(generate.sample(logits, jax.random.key(2), temperature=1.0, top_p=0.7)),
                          minlength=4) / 20000  # the smallest set reaching 0.7: tokens 0 and 1, renormalised
    np.testing.assert_allclose(nucleus, [0.625, 0.375, 0, 0], atol=0.015)
    hot = np.bincount(np.asarray(generate.sample(logits, jax.random.key(3), temperature=2.0, top_p=1.0)),
                      minlength=4) / 20000
    p = np.sqrt([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(hot, p / p.sum(), atol=0.015)
