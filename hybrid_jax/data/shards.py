"""On-disk format of a prepared token dataset and opening it (checked against its manifest) as a
:class:`~hybrid_jax.data.source.TokenSource`.

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
(Llama-3 has 128,256 ids, over uint16). The ``.idx`` document offsets keep documents recoverable and give the
document boundaries of ``data.document_mask``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_jax.data.source import DatasetError, TokenFile, TokenSource

MANIFEST = "manifest.json"
FORMAT = "hybrid_jax.tokens/1"
TOKEN_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<u8")
_KEYS = {"format": str, "num_tokens": int, "vocab_size": int, "eos_id": int, "tokenizer": dict, "shards": list}
_SHARD_KEYS = {"tokens": str, "index": str, "num_tokens": int}


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
class PreparedDataset(TokenSource):
    """A prepared dataset opened once: its manifest, checked against the shard files on disk."""

    directory: str
    manifest: dict
    format = "hybrid_jax"

    @property
    def path(self) -> str:
        return self.directory

    @property
    def num_documents(self) -> int:
        return sum(int(s.get("num_documents", 0)) for s in self.manifest["shards"])

    @property
    def id_remedy(self) -> str:
        return "the data was prepared with another tokenizer than its manifest says: prepare it again"

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

    def token_files(self) -> list[TokenFile]:
        return [TokenFile(p, TOKEN_DTYPE, int(n)) for p, n in zip(self.shard_paths(), self.shard_tokens(), strict=True)]

    def document_starts(self, lo: int, hi: int) -> np.ndarray:
        """A shard holds whole documents: its start and its documents' ends (its ``.idx``) start documents."""
        starts, ends = self._document_ends
        found = []
        for s in range(int(np.searchsorted(starts, lo, side="right")) - 1, len(ends)):
            if starts[s] >= hi:
                break
            inside = ends[s][np.searchsorted(ends[s], lo - starts[s], side="right"):
                             np.searchsorted(ends[s], hi - starts[s], side="left")]
            found += [starts[s : s + 1], starts[s] + inside]
        found = np.concatenate(found)
        return found[(found > lo) & (found < hi)]

    @functools.cached_property
    def _document_ends(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """``[num_shards + 1]`` shard starts in the joined stream and each shard's document ends (its ``.idx``,
        memory-mapped once per process)."""
        ends = [np.memmap(Path(self.directory) / s["index"], dtype="<i8", mode="r") for s in self.manifest["shards"]]
        return np.concatenate([[0], np.cumsum(self.shard_tokens())]), ends

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_document_ends"}

    def describe(self) -> str:
        return f"{self.directory} ({self.num_tokens:,} tokens)"


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
