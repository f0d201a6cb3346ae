"""The training input pipeline: a run config -> this process's :class:`Batch` es, from any position of the stream.

One global stream of ``seq_len + 1`` token sequences, numbered 0, 1, 2, ...:

* ``data.source="mock"``: sequence ``i`` is the Markov-chain sequence ``i`` (:mod:`hybrid_jax.data.mock`).
* ``data.source="tokens"``: the prepared documents of ``data.path`` joined end to end (each already ends in
  EOS) and cut into windows of ``seq_len + 1`` (the FLA/Primus recipe: no padding, windows cross document
  boundaries), shuffled with ``train.seed`` (a fresh permutation every epoch), repeated forever.

A :class:`DataStream` starts at a position (global sequences already consumed). Global batch ``k`` after it is
sequences ``[position + k G, position + (k + 1) G)`` (``G = train.global_batch_size``); process ``p`` of ``n`` takes
every ``n``-th of them from the ``p``-th, ``G / n`` per batch. The position is what a checkpoint saves, so a resumed run
continues with the very next sequence whatever its batch size or process count, and the stream does not depend on
``data.num_workers``.

``data.document_mask``: each batch also carries segment ids (a nondecreasing document index per row, from 0).
Prepared tokens: a document ends at its EOS, so a token's id counts the EOS tokens before it in the window. Mock data:
documents of random lengths up to ``seq_len // 2`` (:class:`~hybrid_jax.data.mock.MockDocuments`). Both are functions
of the window alone: resume is exact as without.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import grain
import numpy as np
from absl import flags
from ml_collections import ConfigDict

from hybrid_jax.data.mock import MarkovSequences, MockDocuments
from hybrid_jax.data.shards import PreparedDataset, TokenWindows, open_dataset

_PREFETCH_BATCHES = 2  # batches read ahead per process (and per worker): each is global_batch/n x seq_len ints


class Batch(NamedTuple):
    """A batch of windows: ``tokens [B, T+1]`` int32 (inputs ``[:, :-1]``, targets ``[:, 1:]``) and, with
    ``data.document_mask``, ``segment_ids [B, T+1]`` int32 (each row's document index per token), else None."""

    tokens: Any
    segment_ids: Any = None


def segment_ids_after_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """``[L]`` tokens -> ``[L]`` int32 segment ids: the number of EOS tokens before each position (a document's EOS
    is its last token)."""
    ends = (tokens == eos_id).astype(np.int32)
    return np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)


class _Row:
    """A sequence -> ``{"tokens": [L]}`` (and ``"segment_ids": [L]`` with documents)."""

    def __init__(self, segments: Callable[[int, np.ndarray], np.ndarray] | None):
        self.segments = segments

    def __call__(self, index_and_tokens: tuple[int, np.ndarray]) -> dict[str, np.ndarray]:
        index, tokens = index_and_tokens
        row = {"tokens": tokens}
        if self.segments is not None:
            row["segment_ids"] = self.segments(index, tokens)
        return row


class _AfterEos:
    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def __call__(self, index: int, tokens: np.ndarray) -> np.ndarray:
        return segment_ids_after_eos(tokens, self.eos_id)


class _MockSegments:
    def __init__(self, documents: MockDocuments):
        self.documents = documents

    def __call__(self, index: int, tokens: np.ndarray) -> np.ndarray:
        return self.documents(index)


def sequences(config: ConfigDict, dataset: PreparedDataset | None) -> grain.MapDataset:
    """The global stream: an (effectively) infinite ``MapDataset`` of rows (``{"tokens": [seq_len + 1]}`` and, with
    ``data.document_mask``, ``"segment_ids"``). ``dataset``: the opened ``data.path`` (None for mock data)."""
    length, seed = config.train.seq_len + 1, config.train.seed
    document_mask = bool(config.data.document_mask)
    if config.data.source == "mock":
        tokens = grain.MapDataset.range(sys.maxsize).map(MarkovSequences(config.model.vocab_size, length, seed))
        segments = _MockSegments(MockDocuments(length, config.train.seq_len // 2, seed)) if document_mask else None
    elif config.data.source == "tokens":
        if dataset is None:
            raise ValueError("data.source='tokens' needs the opened data.path (hybrid_jax.data.shards.open_dataset)")
        windows = TokenWindows(dataset, length, config.model.vocab_size)
        tokens = grain.MapDataset.source(windows).shuffle(seed=seed % 2**32).repeat()
        segments = _AfterEos(dataset.eos_id) if document_mask else None
    else:
        raise ValueError(f"unknown data.source {config.data.source!r}: expected 'mock' or 'tokens'")
    return tokens.map_with_index(_pair).map(_Row(segments))


def _pair(index: int, tokens: np.ndarray) -> tuple[int, np.ndarray]:
    return index, tokens


class DataStream:
    """This process's batches (:class:`Batch` of numpy arrays) from global sequence ``position`` on, forever.

    ``position`` advances by ``train.global_batch_size`` per batch taken; :meth:`saved` is what a checkpoint
    stores. Use as an iterator; :meth:`close` stops its prefetch threads or processes."""

    def __init__(self, config: ConfigDict, dataset: PreparedDataset | None, *, position: int = 0,
                 process_index: int = 0, process_count: int = 1):
        global_batch = config.train.global_batch_size
        if global_batch % process_count:
            raise ValueError(f"train.global_batch_size={global_batch} is not divisible by the process count "
                             f"{process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} is outside [0, {process_count})")
        self.config, self.position, self.global_batch = config, int(position), global_batch
        ds = sequences(config, dataset)[self.position + process_index::process_count]
        ds = ds.batch(global_batch // process_count, drop_remainder=True)
        it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=_PREFETCH_BATCHES))
        if config.data.num_workers > 0:
            if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags; outside an absl app: defaults
                flags.FLAGS.mark_as_parsed()
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.data.num_workers,
                                                                   per_worker_buffer_size=_PREFETCH_BATCHES))
        self._it = iter(it_ds)

    @classmethod
    def open(cls, config: ConfigDict, *, position: int = 0, process_index: int = 0, process_count: int = 1
             ) -> DataStream:
        """The stream of ``config``, opening ``data.path`` itself (a tool or benchmark without a preflight)."""
        dataset = open_dataset(config.data.path) if config.data.source == "tokens" else None
        return cls(config, dataset, position=position, process_index=process_index, process_count=process_count)

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> Batch:
        rows = next(self._it)
        self.position += self.global_batch
        return Batch(rows["tokens"], rows.get("segment_ids"))

    def saved(self) -> dict:
        """The position as a checkpoint saves it: sequences consumed, of which length and seed."""
        return dict(sequences=self.position, seq_len=self.config.train.seq_len, seed=self.config.train.seed)

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def resume_position(saved: dict, config: ConfigDict, log: Callable[[str], None] = print) -> int:
    """The stream position to continue from after a checkpoint's saved data position ``saved``.

    It counts sequences, so a new batch size continues exactly. A new ``seq_len`` (allowed with
    ``train.allow_config_change``) continues after the same number of tokens, a new seed at the same sequence
    number of the new order; both are said. A checkpoint of the older format (Grain's count of batches) is read as
    that many batches of the config's global batch."""
    t = config.train
    if "batches" in saved:
        return int(saved["batches"]) * t.global_batch_size
    position = int(saved["sequences"])
    old_len, old_seed = int(saved.get("seq_len", t.seq_len)), int(saved.get("seed", t.seed))
    if old_len != t.seq_len:
        tokens = position * (old_len + 1)
        position = math.ceil(tokens / (t.seq_len + 1))
        log(f"note: train.seq_len changed {old_len} -> {t.seq_len}: the data continues after the {tokens:,} tokens "
            f"consumed, at sequence {position:,} of the new windows (a new order of the data)")
    if old_seed != t.seed:
        log(f"note: train.seed changed {old_seed} -> {t.seed}: the data continues at sequence {position:,} of the new "
            "seed's order (mock data: a new Markov chain, a new task)")
    return position
