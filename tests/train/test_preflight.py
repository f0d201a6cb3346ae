"""Before the model is built: bad inputs are one line and leave no workdir; the tokenizer comes from the manifest;
validation loss on fixed windows equals the loss recomputed from the saved checkpoint."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax
from hybrid_jax.data.heldout import heldout_windows
from hybrid_jax.data.prepare import Documents, prepare
from hybrid_jax.data.run_tokenizer import NoTokenizer, RunTokenizer, run_tokenizer_path
from hybrid_jax.train.config_checks import ConfigError
from hybrid_jax.train.loop import train
from hybrid_jax.train.step.loss import cross_entropy
from tests.data.util import sample_documents, tiny_hf_tokenizer
from tests.train.common import tiny_config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared dataset (a 300-id BPE tokenizer), a validation jsonl of other documents, another tokenizer."""
    tmp = tmp_path_factory.mktemp("prepared")
    tokenizer = tiny_hf_tokenizer(tmp, sample_documents(60, seed=1))
    prepare(Documents(iter(sample_documents(200, seed=2)), None), tokenizer, tmp / "tokens", progress=False)
    (tmp / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_documents(40, seed=3)))
    (tmp / "other").mkdir()
    other = tiny_hf_tokenizer(tmp / "other", sample_documents(30, seed=9))
    (tmp / "short.jsonl").write_text(json.dumps({"text": "the of"}) + "\n")
    return dict(tokens=tmp / "tokens", tokenizer=tokenizer, val=tmp / "val.jsonl", other=other,
                short=tmp / "short.jsonl", tmp=tmp)


def _tokens_config(prepared, workdir, **overrides):
    c = tiny_config(str(workdir))
    c.model.vocab_size = 320
    c.data.update(dict(source="tokens", path=str(prepared["tokens"])))
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        c[section][name] = value
    return c


BAD = [  # (overrides, the one line it must say)
    ({"data.path": "{tmp}/nowhere"}, r"data.path: .*nowhere has no manifest.json.*python -m hybrid_jax.prepare"),
    ({"model.vocab_size": 256}, r"model.vocab_size=256 is smaller than the 300 ids .* --config.model.vocab_size=300"),
    ({"data.tokenizer": "{tmp}/missing.model"}, r"data.tokenizer: tokenizer file .*missing.model' not found"),
    ({"data.tokenizer": "{other}"}, r"data.tokenizer=.*other/tokenizer.json is not the tokenizer .* prepared with"),
    ({"model.remat": "all"}, r"model.remat='all' must be one of none, mixer, full, dots"),
    ({"model.kernel_impl": "triton"}, r"model.kernel_impl='triton' must be one of auto, xla, pallas"),
    ({"train.seq_len": 4096}, r"holds [\d,]+ tokens: \d+ windows of train.seq_len \+ 1 = 4097, fewer than one batch"),
    ({"data.validation_path": "{tmp}/val.txt"}, r"data.validation_path=.*val.txt not found"),
    ({"data.validation_path": "{short}"}, r"short.jsonl holds \d+ tokens, fewer than one window"),
    ({"model.tuning": "{tmp}/tuning.json"}, r"model.tuning: tuning file .*tuning.json: no such file"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[next(iter(o)) for o, _ in BAD])
def test_bad_inputs_are_one_line_before_any_workdir(prepared, tmp_path, overrides, message):
    paths = {k: str(v) for k, v in prepared.items()}
    overrides = {k: v.format(**paths) if isinstance(v, str) else v for k, v in overrides.items()}
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(_tokens_config(prepared, workdir, **overrides), log=lambda *_: None)
    text = str(e.value)
    assert "\n" not in text and e.value.__cause__ is None, text
    assert __import__("re").search(message, text), text
    assert not workdir.exists()


def test_tokenizer_from_the_manifest_and_validation_loss(prepared, tmp_path):
    config = _tokens_config(prepared, tmp_path, **{"train.steps": 6, "train.eval_every": 3, "train.eval_batches": 2,
                                                   "data.validation_path": str(prepared["val"])})
    assert config.data.tokenizer == ""
    notes = []
    train(config, log=notes.append)
    recorded = str(prepared["tokenizer"].resolve())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["data"]["tokenizer"] == recorded  # the run knows its tokenizer: generate / eval / export find it
    assert any("(from its manifest)" in str(n) for n in notes)
    assert "validation: 2 batches x 16 windows x 32 tokens" in "\n".join(map(str, notes))

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(val) == [3, 6]
    assert val[6]["val_loss"] < val[3]["val_loss"] < math.log(320) + 0.1
    assert val[6]["val_ppl"] == pytest.approx(math.exp(val[6]["val_loss"]), rel=1e-9)

    model, loaded = hybrid_jax.load(tmp_path)  # the same windows scored from the checkpoint: the same number
    windows = heldout_windows(loaded, 2 * 2 * jax.device_count(), RunTokenizer.of(loaded.data.tokenizer)).tokens
    loss = nnx.jit(lambda m, t: cross_entropy(m.features(t[:, :-1]), jnp.asarray(m.embedding), t[:, 1:], chunk_size=96))
    expected = float(loss(model, jnp.asarray(windows)))
    np.testing.assert_allclose(val[6]["val_loss"], expected, rtol=1e-5)

    old = _tokens_config(prepared, tmp_path)  # a run saved before the trainer recorded it: found at read time
    assert run_tokenizer_path(old) == recorded
    gone = _tokens_config(prepared, tmp_path, **{"data.path": str(tmp_path / "gone")})
    with pytest.raises(NoTokenizer, match="whose manifest cannot be read"):
        run_tokenizer_path(gone)


def test_validation_windows_are_fixed_and_carry_segment_ids_with_document_mask(prepared, tmp_path):
    config = _tokens_config(prepared, tmp_path, **{"data.validation_path": str(prepared["val"])})
    tokenizer = RunTokenizer.of(str(prepared["tokenizer"]))
    plain = heldout_windows(config, 40, tokenizer)
    assert plain.tokens.shape == (40, 33) and plain.tokens.dtype == np.int32 and plain.segment_ids is None
    np.testing.assert_array_equal(heldout_windows(config, 3, tokenizer).tokens, plain.tokens[:3])  # same, in order
    config.data.document_mask = True
    packed = heldout_windows(config, 40, tokenizer)
    np.testing.assert_array_equal(packed.tokens, plain.tokens)
    eos = 2  # tiny_hf_tokenizer's </s>
    for tokens, segments in zip(*packed, strict=True):
        np.testing.assert_array_equal(segments, np.concatenate([[0], np.cumsum(tokens[:-1] == eos)]))
    assert packed.segment_ids.max() > 0  # some window spans a document boundary


def test_a_warmup_longer_than_the_run_is_cut_with_a_note():
    from hybrid_jax.train.config_checks import clamp_warmup

    t = tiny_config().train
    t.update(dict(steps=5, warmup_steps=30))
    assert clamp_warmup(t) == ("note: train.warmup_steps=30 is longer than train.steps=5; warming up over all 5 "
                               "steps instead")
    assert t.warmup_steps == 5 and clamp_warmup(t) is None  # once cut (or when it fits) nothing changes


def test_a_step_too_large_for_the_device_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """Issue 49 item 2: zebra_1b_gdn on a 24 GiB CPU box grew to 15 GB of RSS in a minute with no warning."""
    from hybrid_jax.train import preflight
    from tests.conftest import load_config

    config = load_config("zebra_1b_gdn")
    config.train.update(dict(workdir=str(tmp_path / "run"), global_batch_size=128, micro_batch_size=16))
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda: 24 << 30)
    with pytest.raises(ConfigError) as e:
        train(config, log=lambda *_: None)
    assert str(e.value).startswith("the step of zebra_1b_gdn (1.20B parameters) at micro batch 16 x 2048 needs at "
                                   "least ") and str(e.value).endswith("or pass --force to try anyway")
    assert "but a cpu device here has 24.0 GiB" in str(e.value) and not (tmp_path / "run").exists()
    params = preflight.abstract_params(config.model)
    warning = preflight._check_memory(config, params, (8, 1, 1), force=True)
    assert warning.startswith("warning: the step of zebra_1b_gdn")
    assert preflight._check_memory(config, params, (1, 1, 8), force=False) is None  # sequence and moments over 8
    config.model.remat, config.train.micro_batch_size = "full", 1  # what the message suggests
    assert preflight._check_memory(config, params, (8, 1, 1), force=False) is None


def test_memory_estimate_stays_under_the_measured_peaks(monkeypatch):
    """The estimate is a lower bound: for the 3B at 8192 with ``model.remat=dots`` it passes at each measured peak
    (benchmarks/results, one H200) and refuses a device of a little less than its own figure."""
    from hybrid_jax.train import preflight
    from tests.conftest import REPO, load_config

    measured = json.loads((REPO / "benchmarks/results/2026-12-04_mfu_goals.json").read_text())
    search = measured["figures"]["3b_8192_micro_batch_search"]
    config = load_config("zebra_3b")
    assert config.model.remat == "dots" and config.train.seq_len == 8192
    params = preflight.abstract_params(config.model)
    for name, figure in search.items():
        if not name.startswith("micro_batch_"):
            continue
        config.train.micro_batch_size = int(name.removeprefix("micro_batch_"))
        monkeypatch.setattr(preflight, "device_memory_bytes", lambda peak=figure["peak_memory_gib"]: int(peak * 2**30))
        assert preflight._check_memory(config, params, (1, 1, 1), force=False) is None, name
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda: 60 << 30)  # micro batch 4 needs more than 60 GiB
    with pytest.raises(ConfigError):
        preflight._check_memory(config, params, (1, 1, 1), force=False)
