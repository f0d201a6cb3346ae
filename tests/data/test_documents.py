"""``data.document_mask``: batches carry per-token segment ids beside the tokens, from the dataset's document index
(prepared tokens: a document starts right after each EOS) or random document lengths (mock); the tokens are those of
the plain stream and resume is exact."""

import numpy as np
import pytest

from hybrid_jax.data import DataStream
from hybrid_jax.data.pipeline import segment_ids_after_eos
from hybrid_jax.data.prepare import Documents, prepare
from hybrid_jax.data.shards import read_manifest
from tests.data.util import sample_documents, small_config, tiny_hf_tokenizer

SEQ = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokens")
    docs = sample_documents(40, seed=3)
    prepare(Documents(iter(docs), None), tiny_hf_tokenizer(tmp, docs), tmp / "out", shard_tokens=500, progress=False)
    return tmp / "out"


def test_segment_ids_after_eos():
    np.testing.assert_array_equal(segment_ids_after_eos(np.asarray([5, 2, 7, 2, 2, 9]), 2), [0, 0, 1, 1, 2, 3])


@pytest.mark.parametrize("source", ["mock", "tokens"])
def test_batches_carry_segment_ids_and_resume_exactly(source, dataset):
    overrides = {"data.source": source} if source == "mock" else {
        "data.source": "tokens", "data.path": str(dataset), "model.vocab_size": 300}
    plain, masked = (small_config(**overrides, **{"data.document_mask": on}) for on in (False, True))
    plain_batches = [next(it) for it in [DataStream.open(plain)] for _ in range(3)]
    it = DataStream.open(masked)
    batches = [next(it) for _ in range(3)]
    for b, p in zip(batches, plain_batches, strict=True):
        assert p.segment_ids is None
        assert b.segment_ids.dtype == np.int32 and b.segment_ids.shape == b.tokens.shape == p.tokens.shape
        np.testing.assert_array_equal(b.tokens, p.tokens)  # the same tokens as without the mask
        seg = b.segment_ids
        assert (seg[:, 0] == 0).all() and (np.diff(seg, axis=1) >= 0).all() and (np.diff(seg, axis=1) <= 1).all()
    seg = np.concatenate([b.segment_ids for b in batches])
    assert seg[:, -1].max() >= 1  # windows do hold several documents
    if source == "tokens":  # a new document starts right after each EOS
        eos = read_manifest(dataset)["eos_id"]
        tokens = np.concatenate([b.tokens for b in batches])
        np.testing.assert_array_equal(np.diff(seg, axis=1), (tokens[:, :-1] == eos).astype(np.int32))
    resumed = DataStream.open(masked, position=masked.train.global_batch_size)
    np.testing.assert_array_equal(next(resumed).segment_ids, batches[1].segment_ids)
