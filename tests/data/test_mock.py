"""The mock stream: deterministic, Markov-structured, split disjointly over processes, resumable."""

import numpy as np
import pytest

from hybrid_jax.data import DataStream
from hybrid_jax.data.mock import ENTROPY_FLOOR, SUCCESSOR_PROBS, MarkovSequences
from hybrid_jax.data.pipeline import resume_position
from tests.data.util import small_config


def _take(it, n):
    return [next(it).tokens for _ in range(n)]


def _stream(config, **kw) -> DataStream:
    return DataStream(config, None, **kw)


def test_shape_dtype_and_determinism():
    c = small_config()
    a, b = _take(_stream(c), 3), _take(_stream(c), 3)
    assert a[0].shape == (4, 17) and a[0].dtype == np.int32
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], a[1])  # the stream moves on
    other = next(_stream(small_config(**{"train.seed": 8}))).tokens
    assert not np.array_equal(a[0], other)
    assert a[0].min() >= 0 and a[0].max() < 64


def test_transitions_follow_the_chain_with_its_probabilities():
    chain = MarkovSequences(vocab_size=64, length=4001, seed=3)
    seq = np.concatenate([chain(i) for i in range(5)])  # 5 x 4000 transitions within sequences
    succ = chain.successors
    prev, nxt = np.stack([chain(i)[:-1] for i in range(5)]).ravel(), np.stack([chain(i)[1:] for i in range(5)]).ravel()
    rank = np.argmax(succ[prev] == nxt[:, None], axis=1)
    assert (succ[prev, rank] == nxt).all()  # every step goes to one of the token's successors
    freq = np.bincount(rank, minlength=len(SUCCESSOR_PROBS)) / len(rank)
    np.testing.assert_allclose(freq, SUCCESSOR_PROBS, atol=0.02)
    assert 1.1 < ENTROPY_FLOOR < 1.3 < np.log(64)
    assert len(np.unique(seq)) > 32  # the chain visits most of the vocabulary
    np.testing.assert_array_equal(chain(123), MarkovSequences(64, 4001, 3)(123))


def test_processes_split_the_global_batch_disjointly():
    c = small_config()
    (g0, g1) = _take(_stream(c), 2)
    p0 = _take(_stream(c, process_index=0, process_count=2), 2)
    p1 = _take(_stream(c, process_index=1, process_count=2), 2)
    for g, a, b in zip((g0, g1), p0, p1, strict=True):
        assert a.shape == (2, 17)
        np.testing.assert_array_equal(g[0::2], a)
        np.testing.assert_array_equal(g[1::2], b)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_from_a_saved_position_gives_the_next_batch_whatever_the_batch_size(num_workers):
    c = small_config(**{"data.num_workers": num_workers})
    straight = _stream(c)
    expected = _take(straight, 4)
    first = _stream(c)
    _take(first, 3)
    assert first.saved() == dict(sequences=12, seq_len=16, seed=c.train.seed)
    resumed = _stream(c, position=resume_position(first.saved(), c))
    np.testing.assert_array_equal(next(resumed).tokens, expected[3])
    doubled = small_config(**{"train.global_batch_size": 8})  # a new batch size continues at the same sequence
    np.testing.assert_array_equal(next(_stream(doubled, position=resume_position(first.saved(), doubled))).tokens,
                                  np.concatenate(expected[3:4] + _take(straight, 1)))
    for it in (straight, first, resumed):
        it.close()
    np.testing.assert_array_equal(expected[0], next(_stream(small_config())).tokens)  # workers: same stream


def test_older_checkpoints_and_allowed_changes_map_onto_the_stream():
    c = small_config()
    notes = []
    assert resume_position({"batches": 3}, c, notes.append) == 12  # Grain's batch count of the older format
    longer = small_config(**{"train.seq_len": 33})
    assert resume_position(dict(sequences=12, seq_len=16, seed=c.train.seed), longer, notes.append) == 6
    reseeded = small_config(**{"train.seed": 8})
    assert resume_position(dict(sequences=12, seq_len=16, seed=c.train.seed), reseeded, notes.append) == 12
    assert notes == ["note: train.seq_len changed 16 -> 33: the data continues after the 204 tokens consumed, at "
                     "sequence 6 of the new windows (a new order of the data)",
                     f"note: train.seed changed {c.train.seed} -> 8: the data continues at sequence 12 of the new "
                     "seed's order (mock data: a new Markov chain, a new task)"]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="not divisible"):
        _stream(small_config(), process_count=3)
    with pytest.raises(ValueError, match="unknown data.source"):
        _stream(small_config(**{"data.source": "nope"}))
    with pytest.raises(ValueError, match="data.path"):
        _stream(small_config(**{"data.source": "tokens"}))  # no opened dataset
