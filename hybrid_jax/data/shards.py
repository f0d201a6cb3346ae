"""On-disk format of a prepared token dataset, opening it (checked against its manifest), and random access to its
training windows.

A dataset directory holds::

    shard-00000.bin   flat little-endian uint32 token ids: the shard's documents, each followed by EOS
    shard-00000.idx   flat uint64: the end offset (in tokens) of each document in the shard
    ...
    manifest.json     written last: counts, tokenizer (path, sha256), vocab_size, eos_id, shard list

Why flat arrays and not ArrayRecord: training reads fixed windows of ``seq_len + 1`` tokens from the
documents joined end to end, windows that ignore document (and record) boundaries. A flat array opened with
``np.memmap`` gives every window in O(1) as one contiguous slice (two at a shard boundary) with no
decoding, no per-record overhead and no copy beyond the window itself; ArrayRecord would store documents as
records, so a window would need several record reads plus a concatenation. uint32 holds any vocabulary
(Llama-3 has 128,256 ids, over uint16). The ``.idx`` document offsets keep documents recoverable.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "hybrid_jax.tokens/1"
TOKEN_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<u8")
_KEYS = {"format": str, "num_tokens": int, "vocab_size": int, "eos_id": int, "tokenizer": dict, "shards": list}
_SHARD_KEYS = {"tokens": str, "index": str, "num_tokens": int}


class DatasetError(ValueError):
    """A prepared dataset that cannot be read as its manifest describes it; the message says what and what to do."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset, checked to hold every field training reads (one-line errors)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {MANIFEST}: it is not a prepared token dataset, or its preparation did not "
            f"finish. Create it with `python -m hybrid_jax.prepare --input ... --tokenizer ... --output {directory}`."
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path} is unreadable ({type(e).__name__}): prepare the dataset again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise DatasetError(f"{path}: unknown format {got!r}, expected {FORMAT!r}")
    wrong = [k for k, kind in _KEYS.items() if not isinstance(manifest.get(k), kind)]
    wrong += [f"shards[{i}].{k}" for i, s in enumerate(manifest.get("shards") or [])
              for k, kind in _SHARD_KEYS.items() if not isinstance(s, dict) or not isinstance(s.get(k), kind)]
    if wrong:
        raise DatasetError(f"{path} lacks or garbles {', '.join(wrong)}: prepare the dataset again")
    return manifest


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
    """A prepared dataset opened once: its manifest, checked against the shard files on disk."""

    directory: str
    manifest: dict

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def tokenizer(self) -> dict:
        """``{"path", "sha256", ...}`` of the tokenizer it was prepared with."""
        return self.manifest["tokenizer"]

    def shard_paths(self) -> list[str]:
        return [str(Path(self.directory) / s["tokens"]) for s in self.manifest["shards"]]

    def shard_tokens(self) -> np.ndarray:
        """``[num_shards]`` int64: tokens per shard."""
        return np.asarray([s["num_tokens"] for s in self.manifest["shards"]], dtype=np.int64)


def open_dataset(directory: str | Path) -> PreparedDataset:
    """Open a prepared dataset: its manifest (:func:`read_manifest`), each shard present with the size it lists and
    the counts adding up; a :class:`DatasetError` (one line, the file and what to do) otherwise."""
    manifest = read_manifest(directory)
    dataset = PreparedDataset(str(directory), manifest)
    for shard, path in zip(manifest["shards"], dataset.shard_paths(), strict=True):
        try:
            size = Path(path).stat().st_size
        except OSError:
            raise DatasetError(f"{path} is missing: {directory} is incomplete; prepare it again") from None
        if size != shard["num_tokens"] * TOKEN_DTYPE.itemsize:
            raise DatasetError(f"{path} holds {size // TOKEN_DTYPE.itemsize:,} tokens but the manifest lists "
                               f"{shard['num_tokens']:,}: it was truncated or changed; prepare {directory} again")
    if int(dataset.shard_tokens().sum()) != dataset.num_tokens:
        raise DatasetError(f"{Path(directory) / MANIFEST}: num_tokens={dataset.num_tokens:,} but its shards hold "
                           f"{int(dataset.shard_tokens().sum()):,}; prepare the dataset again")
    return dataset


def read_documents(directory: str | Path) -> list[np.ndarray]:
    """Every document of a prepared dataset (EOS included), in order: ``[num_documents]`` arrays of uint32."""
    directory = Path(directory)
    docs = []
    for shard in read_manifest(directory)["shards"]:
        tokens = np.fromfile(directory / shard["tokens"], dtype=TOKEN_DTYPE)
        ends = np.fromfile(directory / shard["index"], dtype=OFFSET_DTYPE)
        docs.extend(np.split(tokens, ends[:-1].astype(np.int64)))
    return docs


class TokenWindows:
    """Grain random-access source: window ``w`` is tokens ``[w*length, (w+1)*length)`` of the joined shards.

    The tail shorter than ``length`` is dropped (no padding). Shards are memory-mapped lazily in each process, so
    the source pickles cheaply into Grain worker processes. A window holding an id ``>= vocab_size`` (a dataset
    prepared with a larger vocabulary than its manifest says) is a :class:`DatasetError` naming the shard.

    Args:
      dataset: an opened prepared dataset.
      length: tokens per window, ``seq_len + 1``.
      vocab_size: ids must be below it (the model's embedding rows).
    """

    def __init__(self, dataset: PreparedDataset, length: int, vocab_size: int):
        self.directory, self.length, self.vocab_size = dataset.directory, length, vocab_size
        self._paths = dataset.shard_paths()
        self._starts = np.concatenate([[0], np.cumsum(dataset.shard_tokens())])  # [num_shards + 1] token offsets
        self._len = int(self._starts[-1]) // self.length
        if self._len == 0:
            raise DatasetError(f"{self.directory} holds {self._starts[-1]} tokens, fewer than one window "
                               f"({self.length})")
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        """Window ``index`` -> ``[length]`` int32."""
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range [0, {self._len})")
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=TOKEN_DTYPE, mode="r") for p in self._paths]
        start, stop = index * self.length, (index + 1) * self.length
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            lo = start - self._starts[shard]
            hi = min(stop, self._starts[shard + 1]) - self._starts[shard]
            pieces.append(self._maps[shard][lo:hi])
            start, shard = self._starts[shard] + hi, shard + 1
        window = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        if int(window.max()) >= self.vocab_size:
            raise DatasetError(f"{self.directory}: window {index} holds token id {int(window.max())}, not below "
                               f"model.vocab_size={self.vocab_size}; the data was prepared with another tokenizer "
                               "than its manifest says: prepare it again")
        return window.astype(np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}
