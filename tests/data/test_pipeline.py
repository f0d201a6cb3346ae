"""The tokens pipeline: windows rebuild the stream, an epoch is a permutation, processes are disjoint, resume."""

import numpy as np
import pytest

from hybrid_jax.data import DataStream
from hybrid_jax.data.prepare import Documents, prepare
from hybrid_jax.data.shards import open_dataset, read_documents
from hybrid_jax.data.source import DatasetError, TokenWindows
from tests.data.util import sample_documents, small_config, tiny_hf_tokenizer

SEQ = 16  # windows of 17 tokens


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A prepared dataset of 80 documents in several shards, so windows cross shard boundaries."""
    tmp = tmp_path_factory.mktemp("tokens")
    docs = sample_documents(80, seed=1)
    tokenizer = tiny_hf_tokenizer(tmp, docs)
    prepare(Documents(iter(docs), None), tokenizer, tmp / "out", shard_tokens=1000, progress=False)
    return tmp / "out"


def _config(path, **overrides):
    return small_config(**{"data.source": "tokens", "data.path": str(path), "model.vocab_size": 300, **overrides})


def _windows(dataset) -> TokenWindows:
    return TokenWindows(open_dataset(dataset), SEQ + 1, 300)


def _stream(config, **kw) -> DataStream:
    return DataStream.open(config, **kw)


def test_windows_concatenate_back_to_the_token_stream(dataset):
    stream = np.concatenate(read_documents(dataset))
    windows = _windows(dataset)
    assert len(windows) == stream.size // (SEQ + 1) > 100
    joined = np.concatenate([windows[i] for i in range(len(windows))])
    assert joined.dtype == np.int32
    np.testing.assert_array_equal(joined, stream[: joined.size])
    with pytest.raises(IndexError):
        windows[len(windows)]


def _window_ids(dataset, batches):
    """Row -> window index (windows of this random text are unique)."""
    windows = _windows(dataset)
    index = {windows[i].tobytes(): i for i in range(len(windows))}
    assert len(index) == len(windows)
    return [index[row.tobytes()] for b in batches for row in b.tokens]


def test_an_epoch_is_a_seeded_permutation_split_disjointly_over_processes(dataset):
    n = len(_windows(dataset))
    steps = n // 4  # global batch 4: one epoch (minus the remainder)
    it = _stream(_config(dataset))
    seen = _window_ids(dataset, [next(it) for _ in range(steps)])
    assert len(set(seen)) == len(seen) == 4 * steps  # no window twice within an epoch
    assert seen != sorted(seen)  # shuffled
    other_seed = _stream(_config(dataset, **{"train.seed": 8}))
    assert _window_ids(dataset, [next(other_seed)]) != seen[:4]
    halves = [_stream(_config(dataset), process_index=p, process_count=2) for p in (0, 1)]
    parts = [_window_ids(dataset, [next(h) for _ in range(steps)]) for h in halves]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(seen)  # together exactly the global stream
    later_epoch = _window_ids(dataset, [next(it) for _ in range(steps)])
    assert later_epoch != seen  # a new permutation each epoch


def test_resume_from_a_position_gives_the_next_batch(dataset):
    cfg = _config(dataset)
    straight = _stream(cfg)
    expected = [next(straight) for _ in range(6)]
    first = _stream(cfg)
    for _ in range(5):
        next(first)
    resumed = _stream(cfg, position=first.saved()["sequences"])
    np.testing.assert_array_equal(next(resumed).tokens, expected[5].tokens)


def test_a_token_beyond_the_vocabulary_is_one_line_naming_the_data(dataset):
    """Without the trainer's up-front check (a stream opened directly), a model vocabulary smaller than the data's
    tokenizer says so when the stream opens, not that the data is damaged."""
    with pytest.raises(DatasetError, match=r"^model.vocab_size=200 is smaller than the \d+ ids of the tokenizer of "
                                           r"\S+: set --config.model.vocab_size=\d+"):
        for _ in range(4):
            next(_stream(_config(dataset, **{"model.vocab_size": 200})))
