"""The training input pipeline: config -> Grain ``DatasetIterator`` of ``[local_batch, seq_len + 1]`` int32.

One global stream of ``seq_len + 1`` token sequences, numbered 0, 1, 2, ...:

* ``data.source="mock"``: sequence ``i`` is the Markov-chain sequence ``i`` (:mod:`hybrid_jax.data.mock`).
* ``data.source="tokens"``: the prepared documents of ``data.path`` joined end to end (each already ends in
  EOS) and cut into windows of ``seq_len + 1`` (the FLA/Primus recipe: no padding, windows cross document
  boundaries), shuffled with ``train.seed`` (a fresh permutation every epoch), repeated forever. The
  manifest's tokenizer must fit ``model.vocab_size`` and, when ``data.tokenizer`` is set, be that file.

Process ``p`` of ``n`` takes sequences ``p, p + n, p + 2n, ...`` and batches them ``global_batch_size / n``
at a time, so global batch ``k`` is sequences ``[k * global_batch_size, (k + 1) * global_batch_size)`` split
disjointly over processes. All index arithmetic happens in Grain ``MapDataset`` transformations, so the
iterator's state is a position: ``get_state()/set_state()`` (and ``grain.checkpoint`` with Orbax) resume at
exactly the next batch, and the stream does not depend on ``data.num_workers``.

``data.document_mask``: each sequence is ``[2, seq_len + 1]``, its tokens and their segment ids (a nondecreasing
document index from 0), so batches are ``[local_batch, 2, seq_len + 1]``. Prepared tokens: a document ends at its
EOS, so a token's id counts the EOS tokens before it in the window. Mock data: documents of random lengths up to
``seq_len // 2`` (:class:`~hybrid_jax.data.mock.MockDocuments`). Both are functions of the window alone: resume is
exact as without.
"""

from __future__ import annotations

import sys

import grain
import numpy as np
from absl import flags
from ml_collections import ConfigDict

from hybrid_jax.data.mock import MarkovSequences, MockDocuments
from hybrid_jax.data.shards import TokenWindows, read_manifest
from hybrid_jax.data.tokenizer import check_vocab, file_sha256

_PREFETCH_BATCHES = 2  # batches read ahead per process (and per worker): each is global_batch/n x seq_len ints


def segment_ids_after_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """``[L]`` tokens -> ``[L]`` int32 segment ids: the number of EOS tokens before each position (a document's EOS
    is its last token)."""
    ends = (tokens == eos_id).astype(np.int32)
    return np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)


class _WithSegments:
    """``[L]`` tokens -> ``[2, L]`` int32: the tokens and their segment ids (``data.document_mask``)."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return np.stack([tokens, segment_ids_after_eos(tokens, self.eos_id)])


class _MockWithSegments:
    """Mock sequence ``index`` -> ``[2, L]``: its tokens and :class:`MockDocuments` segment ids."""

    def __init__(self, tokens: MarkovSequences, documents: MockDocuments):
        self.tokens, self.documents = tokens, documents

    def __call__(self, index: int) -> np.ndarray:
        return np.stack([self.tokens(index), self.documents(index)])


def sequences(config: ConfigDict) -> grain.MapDataset:
    """The global stream: an (effectively) infinite ``MapDataset`` of ``[seq_len + 1]`` int32 sequences (``[2, seq_len
    + 1]`` with ``data.document_mask``: tokens and segment ids)."""
    length = config.train.seq_len + 1
    source = config.data.source
    document_mask = bool(config.data.get("document_mask", False))
    if source == "mock":
        tokens = MarkovSequences(config.model.vocab_size, length, config.train.seed)
        if document_mask:
            tokens = _MockWithSegments(tokens, MockDocuments(length, config.train.seq_len // 2, config.train.seed))
        return grain.MapDataset.range(sys.maxsize).map(tokens)
    if source == "tokens":
        if not config.data.path:
            raise ValueError("data.source='tokens' needs data.path: the --output directory of hybrid_jax.prepare")
        manifest = read_manifest(config.data.path)
        check_vocab(config.model.vocab_size, manifest["vocab_size"], what=f"the tokenizer of {config.data.path}")
        if config.data.tokenizer and file_sha256(config.data.tokenizer) != manifest["tokenizer"]["sha256"]:
            raise ValueError(
                f"data.tokenizer={config.data.tokenizer} is not the tokenizer {config.data.path} was prepared with "
                f"({manifest['tokenizer']['path']}, sha256 {manifest['tokenizer']['sha256'][:12]}...)"
            )
        windows = grain.MapDataset.source(TokenWindows(str(config.data.path), length))
        windows = windows.shuffle(seed=config.train.seed % 2**32).repeat()
        return windows.map(_WithSegments(int(manifest["eos_id"]))) if document_mask else windows
    raise ValueError(f"unknown data.source {source!r}: expected 'mock' or 'tokens'")


def make_train_iterator(
    config: ConfigDict, *, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
    """This process's batches: a Grain iterator yielding ``[global_batch_size // process_count, seq_len + 1]``
    int32 numpy arrays (inputs ``[:, :-1]``, targets ``[:, 1:]``; with ``data.document_mask``
    ``[..., 2, seq_len + 1]``: tokens and segment ids), forever."""
    global_batch = config.train.global_batch_size
    if global_batch % process_count:
        raise ValueError(
            f"train.global_batch_size={global_batch} is not divisible by the process count {process_count}"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside [0, {process_count})")
    local_batch = global_batch // process_count
    ds = sequences(config)[process_index::process_count].batch(local_batch, drop_remainder=True)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=_PREFETCH_BATCHES))
    if config.data.num_workers > 0:
        if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags; outside an absl app, use defaults
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=config.data.num_workers, per_worker_buffer_size=_PREFETCH_BATCHES
            )
        )
    return iter(it_ds)
