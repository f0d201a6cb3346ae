"""Weighted blends of token datasets (ours and Megatron's mixed): the interleaving keeps every share at every prefix,
its counts after any number of samples come in closed form, a resumed stream continues with the identical samples,
the validation blend interleaves the same way, and the metrics rows carry each dataset's tokens."""

import json

import numpy as np
import pytest

from hybrid_jax.data import DataStream
from hybrid_jax.data.blend import BlendError, BlendSchedule, integer_shares, open_blend, parse_blend
from hybrid_jax.data.heldout import heldout_windows
from hybrid_jax.data.megatron import MegatronWriter
from hybrid_jax.data.prepare import Documents, prepare
from tests.data.util import sample_documents, small_config, tiny_hf_tokenizer

HIGH = 300  # our dataset's ids are below it (a 300-id tokenizer), the Megatron dataset's at or above it


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Our prepared dataset (ids < 300) and a Megatron pair of random documents with ids in [300, 600)."""
    tmp = tmp_path_factory.mktemp("blend")
    docs = sample_documents(60, seed=5)
    prepare(Documents(iter(docs), None), tiny_hf_tokenizer(tmp, docs), tmp / "ours", progress=False)
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 60, 100)
    writer = MegatronWriter(str(tmp / "web"), 600)
    writer.add(rng.integers(HIGH, 600, lengths.sum()).astype(np.uint32), lengths)
    writer.finish()
    return dict(ours=str(tmp / "ours"), web=str(tmp / "web"))


def _config(spec: str, **overrides):
    return small_config(**{"data.source": "tokens", "data.path": spec, "model.vocab_size": 600,
                           "train.global_batch_size": 8, **overrides})


def test_a_70_30_blend_keeps_its_shares_at_every_prefix_and_resumes_to_the_identical_samples(paths):
    config = _config(f"0.7 {paths['ours']} 0.3 {paths['web']}")
    straight = DataStream.open(config)
    batches = [next(straight) for _ in range(900)]
    saved = straight.saved()  # what a checkpoint after 900 batches holds
    batches += [next(straight) for _ in range(350)]  # 10,000 samples in all
    tokens = np.concatenate([b.tokens for b in batches])
    web = tokens.max(axis=1) >= HIGH  # [10000] which dataset each sample came from
    assert ((tokens < HIGH).all(axis=1) | web).all()  # every window lies in one dataset
    n = np.arange(1, web.size + 1)
    share = np.cumsum(web) / n
    assert np.abs(share[999:] - 0.3).max() <= 0.005  # within 0.5% at every prefix of at least 1,000 samples
    schedule = open_blend(config.data.path).schedule()
    np.testing.assert_array_equal([schedule.counts(k)[1] for k in n], np.cumsum(web))  # the closed form counts
    assert straight.source_tokens() == {"data_tokens/ours": 7000 * 16, "data_tokens/web": 3000 * 16}

    resumed = DataStream.open(config, position=saved["sequences"])  # a run started again from that checkpoint
    rest = np.concatenate([next(resumed).tokens for _ in range(350)])
    np.testing.assert_array_equal(rest, tokens[900 * 8 :])  # the identical samples


@pytest.mark.parametrize("spec", ["0.5 a 0.3 b 0.2 c", "1 a 1 b 1 c 1 d", "2156346 a 1000000 b 77 c"])
def test_no_dataset_gets_a_sample_ahead_of_its_share_and_counts_come_in_closed_form(spec):
    weights = [w for w, _ in parse_blend(spec)]
    shares, note = integer_shares(weights)
    assert (note is None) == (sum(shares) < 65536)  # token-count weights: rounded to a period of 65,536, said
    schedule = BlendSchedule(shares)
    period = sum(shares)
    picks = np.asarray([schedule[i] for i in range(2 * period + 7)])  # [N, 2]: (dataset, its sample)
    taken = np.cumsum(np.eye(len(shares), dtype=np.int64)[picks[:, 0]], axis=0)  # [N, D] counts after each sample
    for d in range(len(shares)):  # each dataset's samples are taken in order, none skipped
        np.testing.assert_array_equal(picks[picks[:, 0] == d, 1], np.arange((picks[:, 0] == d).sum()))
    n = np.arange(1, len(picks) + 1)[:, None]
    assert (taken - np.asarray(shares) * n / period < 1).all()  # never a whole sample ahead of its share
    for i in np.random.default_rng(0).integers(0, len(picks), 300).tolist() + [period - 1, period, 2 * period]:
        np.testing.assert_array_equal(schedule.counts(i + 1), taken[i])  # the closed form
    big = 10**8 + 3
    assert schedule.counts(big).sum() == big and schedule[big][1] == schedule.counts(big)[schedule[big][0]]
    assert np.abs(schedule.counts(big) / big - np.asarray([float(w / sum(weights)) for w in weights])).max() < 2e-5


BAD_BLENDS = [
    ("0.7 {ours} 0.3", r"give one dataset path, or weight-path pairs as Megatron's --data-path takes them"),
    ("0.7 {ours} heavy {web}", r"the weight 'heavy' before .*web is not a number"),
    ("0.7 {ours} -0.3 {web}", r"the weight -0.3 of .*web must be positive"),
    ("0.7 {ours} 0.3 {ours}/../nowhere", r"nowhere \(in the blend\): .*nowhere has no manifest.json"),
]


@pytest.mark.parametrize("spec,message", BAD_BLENDS, ids=["odd", "not a number", "negative", "missing path"])
def test_a_bad_weight_or_path_is_one_line(paths, spec, message):
    from hybrid_jax.train.config_checks import ConfigError
    from hybrid_jax.train.preflight import _open_data

    with pytest.raises((BlendError, FileNotFoundError), match=message):
        open_blend(spec.format(**paths))
    with pytest.raises(ConfigError, match="^data.path: ") as e:  # as the preflight says it
        _open_data(_config(spec.format(**paths)))
    assert "\n" not in str(e.value)


def test_a_validation_blend_interleaves_each_datasets_first_windows_by_weight(paths):
    config = _config("0.5 a", **{"data.validation_path": f"0.7 {paths['ours']} 0.3 {paths['web']}",
                                 "data.document_mask": True})
    windows = heldout_windows(config, 20, None)
    web = windows.tokens.max(axis=1) >= HIGH
    np.testing.assert_array_equal(web, [0, 1, 0, 0, 0, 1, 0, 0, 1, 0] * 2)  # the 7:3 period, twice
    alone = heldout_windows(_config("0.5 a", **{"data.validation_path": paths["web"], "data.document_mask": True}),
                            6, None)
    np.testing.assert_array_equal(windows.tokens[web], alone.tokens)  # each dataset's first windows, in order
    np.testing.assert_array_equal(windows.segment_ids[web], alone.segment_ids)
    assert alone.segment_ids.max() > 0


def test_the_metrics_rows_carry_each_datasets_tokens(paths, tmp_path):
    from hybrid_jax.train.report.metrics import MetricsLogger

    stream = DataStream.open(_config(f"0.7 {paths['ours']} 0.3 {paths['web']}"), position=80)
    next(stream)
    logger = MetricsLogger(tmp_path, flops_per_token=1.0, tokens_per_step=8 * 16, total_steps=100)
    logger.log(11, {"loss": 1.0, **stream.source_tokens()})  # what the training loop logs
    logger.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (row["data_tokens/ours"], row["data_tokens/web"]) == (62 * 16, 26 * 16)  # 88 sequences: 8 periods and 6 + 2
