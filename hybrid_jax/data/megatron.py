"""Megatron-LM's mmap indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read in place as a
:class:`~hybrid_jax.data.source.TokenSource` and written by ``python -m hybrid_jax.prepare --format megatron``.

The format (megatron/core/datasets/indexed_dataset.py), all little-endian::

    PREFIX.idx   b"MMIDIDX\\x00\\x00"   9 bytes, the magic
                 version               <Q, 1
                 dtype code            <B: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
                 sequence count S      <Q
                 document count D      <Q, the entries of the document index (documents + 1)
                 sequence lengths      int32 [S], in tokens
                 sequence pointers     int64 [S], byte offsets into PREFIX.bin
                 document index        int64 [D], the first sequence of each document, then S
                 (sequence modes       int8 [S], only in a multimodal index)
    PREFIX.bin   the sequences' tokens, one after another, in the dtype

A document is one or more sequences (several with ``preprocess_data.py --split-sentences``). Megatron's
preprocessing appends the EOD token to each document only with ``--append-eod``; without it the documents follow one
another with no separator. Either way we read the tokens as written, as Megatron trains on them, and take the
document boundaries of ``data.document_mask`` from the index. Tokenizers with fewer than 65,500 ids are stored as
uint16, larger ones as int32 (Megatron's ``DType.optimal_dtype``); the writer does the same.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_jax.data.source import DatasetError, TokenFile, TokenSource

BIN, IDX = ".bin", ".idx"
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # the integer codes of Megatron's DType
FLOAT_CODES = {6: "float64", 7: "float32"}
EOD_SAMPLE = 1000  # documents whose last token tells whether the dataset was written with --append-eod
_REMAKE = "tokenize it again with Megatron's tools/preprocess_data.py or python -m hybrid_jax.prepare --format megatron"


@dataclasses.dataclass(frozen=True)
class MegatronDataset(TokenSource):
    """An opened Megatron indexed dataset: its prefix and header; the index arrays are memory-mapped lazily."""

    prefix: str
    dtype_code: int
    sequence_count: int
    document_count: int
    total_tokens: int
    eod_id: int | None  # the token every sampled document ends in (written with --append-eod), else None
    format = "megatron"

    @property
    def path(self) -> str:
        return self.prefix

    @property
    def num_tokens(self) -> int:
        return self.total_tokens

    @property
    def num_documents(self) -> int:
        return self.document_count - 1

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype_code])

    @property
    def id_remedy(self) -> str:
        return ("a Megatron dataset records no vocabulary: set model.vocab_size to its tokenizer's (padded) "
                "vocabulary size")

    def token_files(self) -> list[TokenFile]:
        return [TokenFile(self.prefix + BIN, self.dtype, self.total_tokens)]

    def document_starts(self, lo: int, hi: int) -> np.ndarray:
        lengths, pointers, documents = self._index
        itemsize = self.dtype.itemsize
        first = int(np.searchsorted(pointers, lo * itemsize, side="right"))  # sequences starting after lo
        last = int(np.searchsorted(pointers, hi * itemsize, side="left"))  # ... and before hi
        starting = documents[np.searchsorted(documents, first, side="left"):
                             np.searchsorted(documents, last, side="left")]  # documents whose first sequence is there
        starting = starting[starting < self.sequence_count]
        return pointers[starting] // itemsize

    @functools.cached_property
    def _index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lengths int32 [S], pointers int64 [S], document index int64 [D])``, memory-mapped once per process."""
        s, d, path = self.sequence_count, self.document_count, self.prefix + IDX
        lengths = np.memmap(path, "<i4", "r", offset=HEADER_BYTES, shape=(s,)) if s else np.zeros(0, np.int32)
        pointers = np.memmap(path, "<i8", "r", offset=HEADER_BYTES + 4 * s, shape=(s,)) if s else np.zeros(0, np.int64)
        documents = np.memmap(path, "<i8", "r", offset=HEADER_BYTES + 12 * s, shape=(d,))
        return lengths, pointers, documents

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_index"}

    def describe(self) -> str:
        what = (f"each of its first documents ends in token {self.eod_id} (EOD: written with --append-eod)"
                if self.eod_id is not None else
                "its documents do not end in one common token (written without --append-eod): they are read as "
                "written, joined with no separator as Megatron trains on them; data.document_mask keeps them apart "
                "by the index's boundaries")
        return (f"{self.prefix} (Megatron indexed dataset, {self.dtype.name}, {self.num_documents:,} documents, "
                f"{self.num_tokens:,} tokens; {what})")


def open_megatron(prefix: str) -> MegatronDataset:
    """Open ``prefix``'s ``.idx`` and ``.bin``, checked against each other; FileNotFoundError or a one-line
    :class:`DatasetError` (a truncated or mismatched file, an unknown version or dtype, a multimodal index)."""
    idx, bin_ = Path(prefix + IDX), Path(prefix + BIN)
    for p in (idx, bin_):
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: data.path takes a Megatron dataset's path prefix (PREFIX.bin and "
                                    "PREFIX.idx both there), as Megatron's --data-path does")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:9] != MAGIC[: len(head[:9])]:
        raise DatasetError(f"{idx} does not start with Megatron's {MAGIC!r}: it is not the index of an mmap indexed "
                           f"dataset; {_REMAKE}")
    if len(head) < HEADER_BYTES:
        raise DatasetError(f"{idx} is truncated ({size} bytes, shorter than the {HEADER_BYTES}-byte header); {_REMAKE}")
    version, code, s, d = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise DatasetError(f"{idx} is index version {version}; only version {VERSION} (Megatron-LM's mmap format) is "
                           f"read: {_REMAKE}")
    if code not in DTYPES:
        kind = f"{FLOAT_CODES[code]}, not a token type" if code in FLOAT_CODES else "not one Megatron defines"
        raise DatasetError(f"{idx} names dtype code {code} ({kind}); token ids are uint8, int8, int16, int32, int64 or "
                           f"uint16 (codes 1-5, 8): {_REMAKE}")
    expected = HEADER_BYTES + 12 * s + 8 * d
    if size == expected + s and s:
        raise DatasetError(f"{idx} is a multimodal index (a mode byte per sequence): only text datasets are read; "
                           "give the text dataset's prefix")
    if size != expected:
        raise DatasetError(f"{idx} holds {size:,} bytes but its header ({s:,} sequences, {d:,} document entries) needs "
                           f"{expected:,}: it is truncated or damaged; {_REMAKE}")
    dataset = MegatronDataset(prefix, code, s, d, 0, None)
    lengths, pointers, documents = dataset._index if d else (None, None, np.zeros(0, np.int64))
    if d < 1 or documents[0] != 0 or documents[-1] != s:
        raise DatasetError(f"{idx}: its document index does not run from sequence 0 to {s:,}: it is damaged; "
                           f"{_REMAKE}")
    total = int(lengths.sum(dtype=np.int64))
    itemsize = dataset.dtype.itemsize
    have = bin_.stat().st_size
    if have != total * itemsize or (s and (pointers[0] != 0 or pointers[-1] + lengths[-1] * itemsize != have)):
        raise DatasetError(f"{bin_} holds {have / itemsize:,.0f} {dataset.dtype.name} tokens but {idx.name} lists "
                           f"{total:,}: the .bin is truncated or belongs to another index; {_REMAKE}")
    return dataclasses.replace(dataset, total_tokens=total, eod_id=_common_last_token(dataset, lengths, pointers,
                                                                                      documents))


def _common_last_token(dataset: MegatronDataset, lengths: np.ndarray, pointers: np.ndarray,
                       documents: np.ndarray) -> int | None:
    """The token the first :data:`EOD_SAMPLE` non-empty documents all end in, or None (no common one, or fewer than
    two documents to tell)."""
    last_sequences = documents[1 : EOD_SAMPLE + 1] - 1
    last_sequences = last_sequences[np.diff(documents[: EOD_SAMPLE + 1]) > 0]  # documents of no sequence left out
    last_sequences = last_sequences[lengths[last_sequences] > 0]
    ends = pointers[last_sequences] // dataset.dtype.itemsize + lengths[last_sequences]
    if ends.size < 2:
        return None
    last = np.memmap(dataset.prefix + BIN, dataset.dtype, "r")[ends - 1]
    return int(last[0]) if (last == last[0]).all() else None


def claim_prefix(prefix: str | Path, force: bool) -> None:
    """Make ``prefix``'s folder; refuse an existing ``PREFIX.bin``/``.idx`` unless ``force``, then delete them (the
    index first, so a half-deleted dataset is refused)."""
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    taken = [prefix + ext for ext in (IDX, BIN) if Path(prefix + ext).exists()]
    if taken and not force:
        raise FileExistsError(f"{' and '.join(taken)} exist; pass --force to overwrite them")
    for path in taken:
        Path(path).unlink()


class MegatronWriter:
    """Writes documents as ``PREFIX.bin`` + ``PREFIX.idx``, one sequence per document, as Megatron's
    ``preprocess_data.py`` does: uint16 tokens below 65,500 ids, int32 above. The ``.idx`` is written last (renamed
    into place), so an interrupted run leaves no index and the dataset is refused.

    Args:
      prefix: the output path prefix.
      vocab_size: the tokenizer's ids, which pick the dtype.
    """

    def __init__(self, prefix: str | Path, vocab_size: int):
        self.prefix = str(prefix)
        self.dtype = np.dtype("<u2" if vocab_size < 65500 else "<i4")
        self._lengths: list[np.ndarray] = []
        self._bin = open(self.prefix + BIN, "wb")  # noqa: SIM115 (closed in close())

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` joined ``[sum(lengths)]``, ``lengths [n]`` each (EOS already appended)."""
        tokens.astype(self.dtype).tofile(self._bin)
        self._lengths.append(np.asarray(lengths, np.int64))

    def close(self) -> None:
        self._bin.close()

    def finish(self) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self.close()
        lengths = np.concatenate(self._lengths or [np.zeros(0, np.int64)])
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {lengths.max():,} tokens does not fit Megatron's int32 sequence lengths")
        pointers = (np.cumsum(lengths) - lengths) * self.dtype.itemsize
        code = next(c for c, name in DTYPES.items() if np.dtype(name) == self.dtype)
        tmp = self.prefix + IDX + ".tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, code, lengths.size, lengths.size + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(lengths.size + 1, dtype="<i8").tobytes())
        os.replace(tmp, self.prefix + IDX)
