"""The training input pipeline: a run config -> this process's :class:`Batch` es, from any position of the stream.

One global stream of ``seq_len + 1`` token sequences, numbered 0, 1, 2, ...:

* ``data.source="mock"``: sequence ``i`` is the Markov-chain sequence ``i`` (:mod:`hybrid_jax.data.mock`).
* ``data.source="tokens"`` or ``"megatron"``: the documents of ``data.path`` (our prepared directory or a
  Megatron ``.bin/.idx`` prefix: :mod:`hybrid_jax.data.source`) joined end to end and cut into windows of
  ``seq_len + 1`` (the FLA/Primus recipe: no padding, windows cross document boundaries), shuffled with
  ``train.seed`` (a fresh permutation every epoch), repeated forever. A blend (``"0.7 a 0.3 b"``,
  :mod:`hybrid_jax.data.blend`) interleaves such streams, one per dataset, by weight: sequence ``i`` is the next
  window of the dataset furthest behind its share.

A :class:`DataStream` starts at a position (global sequences already consumed). Global batch ``k`` after it is
sequences ``[position + k G, position + (k + 1) G)`` (``G = train.global_batch_size``); process ``p`` of ``n`` takes
every ``n``-th of them from the ``p``-th, ``G / n`` per batch. The position is what a checkpoint saves, so a resumed run
continues with the very next sequence whatever its batch size or process count, and the stream does not depend on
``data.num_workers``.

``data.document_mask``: each batch also carries segment ids (a nondecreasing document index per row, from 0).
Token datasets: from the document boundaries of their index (ours: the ``.idx`` document ends, which follow each
EOS; Megatron's: the document index), so a token's id counts the documents that start in the window before it. Mock
data: documents of random lengths up to ``seq_len // 2`` (:class:`~hybrid_jax.data.mock.MockDocuments`). Both are
functions of the window alone: resume is exact as without.
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

from hybrid_jax.data.blend import Blend, open_blend
from hybrid_jax.data.mock import MarkovSequences, MockDocuments
from hybrid_jax.data.source import TokenWindows

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


class _MockRow:
    """A mock sequence -> ``{"tokens": [L]}`` (and ``"segment_ids": [L]`` with documents)."""

    def __init__(self, documents: MockDocuments | None):
        self.documents = documents

    def __call__(self, index: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
        row = {"tokens": tokens}
        if self.documents is not None:
            row["segment_ids"] = self.documents(index)
        return row


class _WindowRow:
    """A window index of a token dataset -> ``{"tokens": [L]}`` (and ``"segment_ids": [L]`` with documents)."""

    def __init__(self, windows: TokenWindows, document_mask: bool):
        self.windows, self.document_mask = windows, document_mask

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        row = {"tokens": self.windows[index]}
        if self.document_mask:
            row["segment_ids"] = self.windows.segment_ids(index)
        return row


def dataset_rows(windows: TokenWindows, seed: int, document_mask: bool) -> grain.MapDataset:
    """One dataset's endless stream of rows: its windows in a fresh seeded permutation every epoch."""
    return grain.MapDataset.range(len(windows)).shuffle(seed=seed % 2**32).repeat().map(
        _WindowRow(windows, document_mask))


def sequences(config: ConfigDict, data: Blend | None) -> grain.MapDataset:
    """The global stream: an (effectively) infinite ``MapDataset`` of rows (``{"tokens": [seq_len + 1]}`` and, with
    ``data.document_mask``, ``"segment_ids"``). ``data``: the opened ``data.path`` (None for mock data)."""
    length, seed = config.train.seq_len + 1, config.train.seed
    document_mask = bool(config.data.document_mask)
    if config.data.source == "mock":
        documents = MockDocuments(length, config.train.seq_len // 2, seed) if document_mask else None
        tokens = grain.MapDataset.range(sys.maxsize).map(MarkovSequences(config.model.vocab_size, length, seed))
        return tokens.map_with_index(_MockRow(documents))
    if config.data.source not in ("tokens", "megatron"):
        raise ValueError(f"unknown data.source {config.data.source!r}: expected 'mock', 'tokens' or 'megatron'")
    if data is None:
        raise ValueError(f"data.source={config.data.source!r} needs the opened data.path "
                         "(hybrid_jax.data.blend.open_blend)")
    streams = [dataset_rows(TokenWindows(s, length, config.model.vocab_size), seed, document_mask)
               for s in data.sources]
    return streams[0] if len(streams) == 1 else grain.MapDataset.select_from_datasets(streams, data.schedule())


class DataStream:
    """This process's batches (:class:`Batch` of numpy arrays) from global sequence ``position`` on, forever.

    ``position`` advances by ``train.global_batch_size`` per batch taken; :meth:`saved` is what a checkpoint
    stores; :meth:`source_tokens` says how many tokens each dataset of a blend gave so far. Use as an iterator;
    :meth:`close` stops its prefetch threads or processes."""

    def __init__(self, config: ConfigDict, data: Blend | None, *, position: int = 0,
                 process_index: int = 0, process_count: int = 1):
        global_batch = config.train.global_batch_size
        if global_batch % process_count:
            raise ValueError(f"train.global_batch_size={global_batch} is not divisible by the process count "
                             f"{process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} is outside [0, {process_count})")
        self.config, self.position, self.global_batch = config, int(position), global_batch
        self._blend = data if data is not None and len(data.sources) > 1 else None
        self._schedule = self._blend.schedule() if self._blend is not None else None
        ds = sequences(config, data)[self.position + process_index::process_count]
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
        data = None if config.data.source == "mock" else open_blend(config.data.path, config.data.source)
        return cls(config, data, position=position, process_index=process_index, process_count=process_count)

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> Batch:
        rows = next(self._it)
        self.position += self.global_batch
        return Batch(rows["tokens"], rows.get("segment_ids"))

    def saved(self) -> dict:
        """The position as a checkpoint saves it: sequences consumed, of which length and seed."""
        return dict(sequences=self.position, seq_len=self.config.train.seq_len, seed=self.config.train.seed)

    def source_tokens(self) -> dict[str, int]:
        """For a blend, ``{"data_tokens/LABEL": tokens}``: each dataset's tokens trained on so far (its sequences among
        the ``position`` consumed, times ``seq_len``), computed in O(1) of the position; empty otherwise."""
        if self._schedule is None:
            return {}
        counts = self._schedule.counts(self.position) * self.config.train.seq_len
        return {f"data_tokens/{label}": int(n) for label, n in zip(self._blend.labels, counts, strict=True)}

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
