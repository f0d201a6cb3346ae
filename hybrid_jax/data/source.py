"""The token datasets training reads, behind one interface: a dataset opened once (:class:`TokenSource`), its
training windows by random access (:class:`TokenWindows`), and :func:`open_source`, which tells the formats apart.

Two formats, each a sequence of documents laid end to end in flat token files:

* ours (``python -m hybrid_jax.prepare``): a directory with ``manifest.json`` and uint32 shards
  (:mod:`hybrid_jax.data.shards`);
* Megatron-LM's mmap indexed dataset: ``PREFIX.bin`` + ``PREFIX.idx``, ``data.path`` naming the prefix as
  Megatron's ``--data-path`` does (:mod:`hybrid_jax.data.megatron`).

A source says which files hold its tokens (with their dtype and token counts) and where its documents start; the
windows, shuffling, document boundaries and resume are then one piece of code for both.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hybrid_jax.data.tokenizer import check_vocab


class DatasetError(ValueError):
    """A token dataset that cannot be read as its index or manifest describes it; the message says what and what to
    do."""


class TokenFile(NamedTuple):
    """One flat file of token ids: its path, dtype and number of tokens."""

    path: str
    dtype: np.dtype
    num_tokens: int


class TokenSource(abc.ABC):
    """A token dataset opened once (its index checked against its files): the joined token stream's files and its
    documents' boundaries. Implementations are small picklable records (they travel into Grain worker processes) that
    open their files lazily."""

    format: str  # "hybrid_jax" or "megatron": what the notes and errors call it

    @property
    @abc.abstractmethod
    def path(self) -> str:
        """The dataset as ``data.path`` names it (our directory, Megatron's path prefix)."""

    @property
    @abc.abstractmethod
    def num_tokens(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_documents(self) -> int: ...

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the dataset records (ours: the tokenizer's), None when it records none (Megatron's)."""
        return None

    @property
    def tokenizer(self) -> dict | None:
        """``{"path", "sha256", ...}`` of the tokenizer it records, None when it records none."""
        return None

    @property
    def id_remedy(self) -> str:
        """What to do about a token id beyond ``model.vocab_size`` (the end of that error's line)."""
        return "set model.vocab_size to the tokenizer's vocabulary, or train on data of the model's tokenizer"

    @abc.abstractmethod
    def token_files(self) -> list[TokenFile]:
        """The files whose tokens, joined in this order, are the dataset's token stream."""

    @abc.abstractmethod
    def document_starts(self, lo: int, hi: int) -> np.ndarray:
        """Int64 offsets ``t`` of the joined stream with ``lo < t < hi`` at which a document starts, ascending (a
        value may repeat where a document is empty)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the run's start: what the dataset is and how many tokens and documents it holds."""


class TokenWindows:
    """Random-access windows of a source: window ``w`` is tokens ``[w*length, (w+1)*length)`` of the joined stream.

    The tail shorter than ``length`` is dropped (no padding). Files are memory-mapped lazily in each process, so the
    object pickles cheaply into Grain worker processes. A window holding an id outside ``[0, vocab_size)`` is a
    :class:`DatasetError` naming the dataset and the window; a recorded vocabulary larger than ``vocab_size`` is one
    when the windows are made.

    Args:
      source: an opened dataset.
      length: tokens per window, ``seq_len + 1``.
      vocab_size: ids must be below it (the model's embedding rows).
    """

    def __init__(self, source: TokenSource, length: int, vocab_size: int):
        if source.vocab_size is not None:  # a recorded vocabulary the model does not cover: refused before a read
            try:
                check_vocab(vocab_size, source.vocab_size, what=f"the tokenizer of {source.path}")
            except ValueError as e:
                raise DatasetError(str(e)) from None
        self.source, self.length, self.vocab_size = source, length, vocab_size
        files = source.token_files()
        self._files = [(f.path, f.dtype) for f in files]
        self._signed = any(f.dtype.kind == "i" for f in files)
        self._starts = np.concatenate([[0], np.cumsum([f.num_tokens for f in files], dtype=np.int64)])  # [files + 1]
        self._len = int(self._starts[-1]) // self.length
        if self._len == 0:
            raise DatasetError(f"{source.path} holds {self._starts[-1]} tokens, fewer than one window ({self.length})")
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        """Window ``index`` -> ``[length]`` int32."""
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range [0, {self._len})")
        if self._maps is None:
            self._maps = [np.memmap(path, dtype=dtype, mode="r") for path, dtype in self._files]
        start, stop = index * self.length, (index + 1) * self.length
        part = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            lo = start - self._starts[part]
            hi = min(stop, self._starts[part + 1]) - self._starts[part]
            pieces.append(self._maps[part][lo:hi])
            start, part = self._starts[part] + hi, part + 1
        window = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        high = int(window.max())
        if high >= self.vocab_size:
            raise DatasetError(f"{self.source.path}: window {index} holds token id {high}, not below "
                               f"model.vocab_size={self.vocab_size}; {self.source.id_remedy}")
        if self._signed and (low := int(window.min())) < 0:
            raise DatasetError(f"{self.source.path}: window {index} holds the negative token id {low}: the dataset "
                               "is damaged or its index names the wrong dtype; tokenize it again")
        return window.astype(np.int32)

    def segment_ids(self, index: int) -> np.ndarray:
        """``[length]`` int32: each token's document within window ``index``, counted from 0 at its first token (the
        source's document boundaries; an empty document takes no number)."""
        start = index * self.length
        cuts = np.unique(self.source.document_starts(start, start + self.length)) - start
        marks = np.zeros(self.length, np.int32)
        marks[cuts] = 1
        return np.cumsum(marks, dtype=np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}


def open_source(path: str, expect: str = "tokens") -> TokenSource:
    """Open the dataset at ``path``, its format detected: a directory is ours (``manifest.json``), a path whose
    ``.idx`` exists is a Megatron prefix. ``expect`` (``data.source``: ``tokens`` or ``megatron``) picks the advice
    when neither is there. Raises FileNotFoundError or :class:`DatasetError` (one line, what to do)."""
    from hybrid_jax.data.megatron import BIN, IDX, open_megatron
    from hybrid_jax.data.shards import open_dataset

    p = Path(path).expanduser()
    if p.suffix in (BIN, IDX) and not p.is_dir() and Path(str(p)[: -len(p.suffix)] + IDX).is_file():
        raise DatasetError(f"{path} names a file of a Megatron dataset: give its path prefix without {p.suffix} "
                           f"({str(path)[: -len(p.suffix)]}), as Megatron's --data-path takes it")
    if p.is_dir():
        return open_dataset(p)
    if Path(str(p) + IDX).exists() or Path(str(p) + BIN).exists() or expect == "megatron":
        return open_megatron(str(p))
    return open_dataset(p)  # its FileNotFoundError says how to prepare one
