"""On-disk format of a prepared token dataset, and random access to its training windows.

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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "hybrid_jax.tokens/1"
TOKEN_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<u8")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset; a clear error when the directory is not one (or is unfinished)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {MANIFEST}: it is not a prepared token dataset, or its preparation did not "
            f"finish. Create it with `python -m hybrid_jax.prepare --input ... --tokenizer ... --output {directory}`."
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def read_documents(directory: str | Path) -> list[np.ndarray]:
    """Every document of a prepared dataset (EOS included), in order: ``[num_documents]`` arrays of uint32."""
    directory = Path(directory)
    docs = []
    for shard in read_manifest(directory)["shards"]:
        tokens = np.fromfile(directory / shard["tokens"], dtype=TOKEN_DTYPE)
        ends = np.fromfile(directory / shard["index"], dtype=OFFSET_DTYPE)
        docs.extend(np.split(tokens, ends[:-1].astype(np.int64)))
    return docs


@dataclass
class TokenWindows:
    """Grain random-access source: window ``w`` is tokens ``[w*length, (w+1)*length)`` of the joined shards.

    The tail shorter than ``length`` is dropped (no padding). Shards are memory-mapped lazily in each
    process, so the source pickles cheaply into Grain worker processes.

    Args:
      directory: a prepared dataset (see module docstring).
      length: tokens per window, ``seq_len + 1``.
    """

    directory: str
    length: int

    def __post_init__(self):
        manifest = read_manifest(self.directory)
        self._paths = [str(Path(self.directory) / s["tokens"]) for s in manifest["shards"]]
        counts = np.asarray([s["num_tokens"] for s in manifest["shards"]], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])  # [num_shards + 1] token offset of each shard
        self._len = int(self._starts[-1]) // self.length
        if self._len == 0:
            raise ValueError(f"{self.directory} holds {self._starts[-1]} tokens, fewer than one window ({self.length})")
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
        return np.concatenate(pieces).astype(np.int32) if len(pieces) > 1 else pieces[0].astype(np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}
