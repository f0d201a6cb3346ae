"""The tokenizer of a run: ``data.tokenizer``, or the one its prepared dataset's manifest records.

A run trained with ``data.source=tokens`` and no ``data.tokenizer`` still knows its tokenizer: ``prepare`` wrote
the file's path and sha256 into ``DATA/manifest.json`` (a Megatron dataset records none: such a run needs
``data.tokenizer``). The trainer fills ``data.tokenizer`` from there before it
saves the run's config (:func:`tokenizer_from_manifest`), and the tools that read a run (generate, eval, explore,
export) call :func:`run_tokenizer_path`, which also finds it for runs saved before the trainer did so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ml_collections import ConfigDict

from hybrid_jax.data.shards import read_manifest
from hybrid_jax.data.tokenizer import Tokenizer, file_sha256, load_tokenizer

MOCK_NOTE = "this run has no tokenizer (it trained on mock data, data.source=mock)"


class NoTokenizer(ValueError):
    """The run has no tokenizer that can be opened here; the message says why and what to pass."""


@dataclasses.dataclass
class RunTokenizer:
    """A run's tokenizer file, hashed once and opened at most once."""

    path: str
    sha256: str
    _tokenizer: Tokenizer | None = None

    @classmethod
    def of(cls, path: str) -> RunTokenizer:
        return cls(path, file_sha256(path))

    def load(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


def tokenizer_from_manifest(manifest: dict, data_path: str | Path) -> RunTokenizer:
    """The tokenizer recorded in ``data_path``'s ``manifest``, checked to exist and to match its sha256.

    Raises :class:`NoTokenizer` (naming the file and ``--config.data.tokenizer``) when the recorded file is not on
    this machine or has changed since the data was prepared.
    """
    recorded = manifest["tokenizer"]
    path, sha = recorded.get("path", ""), recorded.get("sha256", "")
    if not Path(path).is_file():
        raise NoTokenizer(f"{data_path} was prepared with the tokenizer {path}, which is not on this machine: "
                          f"pass --config.data.tokenizer=PATH (a copy with sha256 {sha[:12]}...)")
    found = RunTokenizer.of(path)
    if found.sha256 != sha:
        raise NoTokenizer(f"the tokenizer {path} changed since {data_path} was prepared (sha256 {sha[:12]}... "
                          f"recorded): pass --config.data.tokenizer=PATH to the original file")
    return found


def run_tokenizer_path(config: ConfigDict) -> str | None:
    """``data.tokenizer`` if set; else the manifest's tokenizer of ``data.path`` (of its first prepared dataset, in a
    blend); None for mock data.

    Raises :class:`NoTokenizer` when the run trained on token data but its tokenizer cannot be found (a Megatron
    dataset records none).
    """
    if config.data.tokenizer:
        return config.data.tokenizer
    if config.data.source == "mock":
        return None
    paths = config.data.path.split()[1::2] or [config.data.path]  # a blend's paths, or the one path
    prepared = [p for p in paths if Path(p).is_dir() or not Path(f"{p}.idx").exists()]
    if not prepared:
        raise NoTokenizer(f"the run trained on the Megatron dataset {paths[0]}, which records no tokenizer, and "
                          "data.tokenizer is empty: pass the tokenizer file it was tokenized with")
    try:
        manifest = read_manifest(prepared[0])
    except (FileNotFoundError, ValueError) as e:
        raise NoTokenizer(f"the run trained on {prepared[0]}, whose manifest cannot be read "
                          f"({e.__class__.__name__}), and data.tokenizer is empty: pass the tokenizer file it was "
                          "prepared with") from None
    return tokenizer_from_manifest(manifest, prepared[0]).path


def run_tokenizer(config: ConfigDict) -> Tokenizer | None:
    """The run's tokenizer (:func:`run_tokenizer_path`), or None when it trained on mock data."""
    path = run_tokenizer_path(config)
    return load_tokenizer(path) if path else None
