"""The tokens pipeline: windows rebuild the stream, an epoch is a permutation, processes are disjoint, resume."""

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from hybrid_jax.data import make_train_iterator
from hybrid_jax.data.prepare import Documents, prepare
from hybrid_jax.data.shards import TokenWindows, read_documents
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


def test_windows_concatenate_back_to_the_token_stream(dataset):
    stream = np.concatenate(read_documents(dataset))
    windows = TokenWindows(str(dataset), SEQ + 1)
    assert len(windows) == stream.size // (SEQ + 1) > 100
    joined = np.concatenate([windows[i] for i in range(len(windows))])
    assert joined.dtype == np.int32
    np.testing.assert_array_equal(joined, stream[: joined.size])
    with pytest.raises(IndexError):
        windows[len(windows)]


def _window_ids(dataset, batches):
    """Row -> window index (windows of this random text are unique)."""
    windows = TokenWindows(str(dataset), SEQ + 1)
    index = {windows[i].tobytes(): i for i in range(len(windows))}
    assert len(index) == len(windows)
    return [index[row.tobytes()] for b in batches for row in b]


def test_an_epoch_is_a_seeded_permutation_split_disjointly_over_processes(dataset):
    n = len(TokenWindows(str(dataset), SEQ + 1))
    steps = n // 4  # global batch 4: one epoch (minus the remainder)
    it = make_train_iterator(_config(dataset))
    seen = _window_ids(dataset, [next(it) for _ in range(steps)])
    assert len(set(seen)) == len(seen) == 4 * steps  # no window twice within an epoch
    assert seen != sorted(seen)  # shuffled
    other_seed = make_train_iterator(_config(dataset, **{"train.seed": 8}))
    assert _window_ids(dataset, [next(other_seed)]) != seen[:4]
    halves = [make_train_iterator(_config(dataset), process_index=p, process_count=2) for p in (0, 1)]
    parts = [_window_ids(dataset, [next(h) for _ in range(steps)]) for h in halves]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(seen)  # together exactly the global stream
    later_epoch = _window_ids(dataset, [next(it) for _ in range(steps)])
    assert later_epoch != seen  # a new permutation each epoch


def test_resume_after_n_batches_gives_the_next_batch(dataset, tmp_path):
    cfg = _config(dataset)
    straight = make_train_iterator(cfg)
    expected = [next(straight) for _ in range(6)]
    first = make_train_iterator(cfg)
    for _ in range(5):
        next(first)
    resumed = make_train_iterator(cfg)
    resumed.set_state(first.get_state())
    np.testing.assert_array_equal(next(resumed), expected[5])
    # The same through an Orbax checkpoint, as the trainer stores it.
    manager = ocp.CheckpointManager(tmp_path)
    manager.save(6, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(resumed)))
    manager.wait_until_finished()
    restored = make_train_iterator(cfg)
    manager.restore(6, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    np.testing.assert_array_equal(next(restored), next(straight))


def test_vocab_size_and_tokenizer_are_checked_against_the_manifest(dataset, tmp_path):
    with pytest.raises(ValueError, match="model.vocab_size=256 is smaller than the 300 ids"):
        make_train_iterator(_config(dataset, **{"model.vocab_size": 256}))
    next(make_train_iterator(_config(dataset, **{"data.tokenizer": str(dataset.parent / "tokenizer.json")})))
    other = tiny_hf_tokenizer(tmp_path, sample_documents(20, seed=5))
    with pytest.raises(ValueError, match="is not the tokenizer"):
        make_train_iterator(_config(dataset, **{"data.tokenizer": str(other)}))
