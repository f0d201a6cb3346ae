"""The tokenizer of a run: ``data.tokenizer``, or the one its prepared dataset's manifest records.

A run trained with ``data.source=tokens`` and no ``data.tokenizer`` still knows its tokenizer: ``prepare`` wrote
the file's path and sha256 into ``DATA/manifest.json``. The trainer fills ``data.tokenizer`` from there before it
saves the run's config (:func:`tokenizer_from_manifest`), and the tools that read a run (generate, eval, explore,
export) call :func:`run_tokenizer_path`, which also finds it for runs saved before the trainer did so.
"""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

from hybrid_jax.data.shards import read_manifest
from hybrid_jax.data.tokenizer import Tokenizer, file_sha256, load_tokenizer


class NoTokenizer(ValueError):
    """The run has no tokenizer that can be opened here; the message says why and what to pass."""


def tokenizer_from_manifest(data_path: str | Path) -> str:
    """The tokenizer path recorded in ``data_path``'s manifest, checked to exist and to match its sha256.

    Raises :class:`NoTokenizer` (naming the file and ``--config.data.tokenizer``) when the recorded file is not on
    this machine or has changed since the data was prepared.
    """
    recorded = read_manifest(data_path)["tokenizer"]
    path, sha = recorded["path"], recorded["sha256"]
    if not Path(path).is_file():
        raise NoTokenizer(f"{data_path} was prepared with the tokenizer {path}, which is not on this machine: "
                          f"pass --config.data.tokenizer=PATH (a copy with sha256 {sha[:12]}...)")
    if file_sha256(path) != sha:
        raise NoTokenizer(f"the tokenizer {path} changed since {data_path} was prepared (sha256 {sha[:12]}... "
                          f"recorded): pass --config.data.tokenizer=PATH to the original file")
    return path


def run_tokenizer_path(config: ConfigDict) -> str | None:
    """``data.tokenizer`` if set; else, for ``data.source=tokens``, the manifest's tokenizer; None for mock data.

    Raises :class:`NoTokenizer` when the run trained on prepared tokens but its tokenizer cannot be found.
    """
    if config.data.tokenizer:
        return config.data.tokenizer
    if config.data.source != "tokens":
        return None
    try:
        return tokenizer_from_manifest(config.data.path)
    except FileNotFoundError as e:
        raise NoTokenizer(f"the run trained on {config.data.path}, whose manifest is gone ({e.__class__.__name__}), "
                          "and data.tokenizer is empty: pass the tokenizer file it was prepared with") from None


def run_tokenizer(config: ConfigDict) -> Tokenizer | None:
    """The run's tokenizer (:func:`run_tokenizer_path`), or None when it trained on mock data."""
    path = run_tokenizer_path(config)
    return load_tokenizer(path) if path else None


MOCK_NOTE = "this run has no tokenizer (it trained on mock data, data.source=mock)"
