"""Held-out validation windows: a fixed ``[n, seq_len + 1]`` int32 array, the same at every evaluation.

``data.validation_path`` is one of

* a prepared dataset directory (``python -m hybrid_jax.prepare --output``): its first windows, in order, after
  checking it was prepared with the run's tokenizer (same sha256) and fits ``model.vocab_size``;
* a ``.jsonl(.gz)`` / ``.parquet`` file of documents (``text`` column): tokenized here with the run's tokenizer,
  each document followed by EOS, joined and cut into windows (like the training stream, unshuffled);
* ``"mock"`` (mock-data runs): Markov-chain sequences at indices far beyond any training stream's.

The windows are taken in order from the start, never shuffled, so every evaluation (and a resumed run's) scores
exactly the same tokens. With ``data.document_mask`` each window is ``[2, seq_len + 1]``, its tokens and their
segment ids (the EOS tokens before each position), as the training batches are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.data.mock import MarkovSequences
from hybrid_jax.data.shards import TokenWindows, read_manifest
from hybrid_jax.data.tokenizer import check_vocab, file_sha256, load_tokenizer

MOCK_OFFSET = 2**62  # mock validation sequences start here; training reads indices from 0 upwards
DOCUMENT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


def validation_windows(config: ConfigDict, count: int) -> np.ndarray:
    """Up to ``count`` windows of ``train.seq_len + 1`` tokens of ``data.validation_path`` (fewer if it is short).

    ``data.tokenizer`` must already name the run's tokenizer for a documents file (the trainer fills it from the
    training data's manifest). Raises ValueError / FileNotFoundError with what to change.
    """
    path, length = config.data.validation_path, config.train.seq_len + 1
    if path == "mock":
        if config.data.get("document_mask", False):
            raise ValueError("data.validation_path='mock' does not support data.document_mask yet; validate on a "
                             "prepared dataset or a .jsonl of documents")
        chain = MarkovSequences(config.model.vocab_size, length, config.train.seed)
        return np.stack([chain(MOCK_OFFSET + i) for i in range(count)])
    windows, eos_id = _file_windows(config, Path(path).expanduser(), length, count)
    if config.data.get("document_mask", False):
        from hybrid_jax.data.pipeline import segment_ids_after_eos

        return np.stack([np.stack([w, segment_ids_after_eos(w, eos_id)]) for w in windows])
    return windows


def _file_windows(config: ConfigDict, p: Path, length: int, count: int) -> tuple[np.ndarray, int]:
    """The windows of a prepared directory or a documents file, and the EOS id that ends each document."""
    path = config.data.validation_path
    if p.is_dir():
        return _prepared_windows(config, p, length, count), int(read_manifest(p)["eos_id"])
    if not p.is_file():
        raise FileNotFoundError(f"data.validation_path={path} not found: give a prepared dataset directory, a "
                                ".jsonl/.parquet file of documents, or 'mock'")
    if not p.name.endswith(DOCUMENT_SUFFIXES):
        raise ValueError(f"data.validation_path={path}: expected a .jsonl(.gz) or .parquet file of documents or a "
                         "prepared dataset directory")
    return _document_windows(config, p, length, count), load_tokenizer(config.data.tokenizer).eos_id


def _prepared_windows(config: ConfigDict, directory: Path, length: int, count: int) -> np.ndarray:
    manifest = read_manifest(directory)
    check_vocab(config.model.vocab_size, manifest["vocab_size"], what=f"the tokenizer of {directory}")
    if config.data.tokenizer and file_sha256(config.data.tokenizer) != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"data.validation_path={directory} was prepared with {manifest['tokenizer']['path']}, not "
                         f"with the run's tokenizer {config.data.tokenizer}: prepare it with the same tokenizer")
    windows = TokenWindows(str(directory), length)
    return np.stack([windows[i] for i in range(min(count, len(windows)))])


def _document_windows(config: ConfigDict, path: Path, length: int, count: int) -> np.ndarray:
    from hybrid_jax.data.prepare import open_documents

    if not config.data.tokenizer:
        raise ValueError(f"data.validation_path={path} holds documents but the run has no tokenizer to encode them "
                         "with: set data.tokenizer (or train on prepared tokens whose manifest names one)")
    tokenizer = load_tokenizer(config.data.tokenizer)
    check_vocab(config.model.vocab_size, tokenizer.vocab_size)
    need, tokens = count * length, []
    have = 0
    for text in open_documents(str(path)).texts:
        ids = tokenizer.encode(text or "") + [tokenizer.eos_id]
        tokens.extend(ids)
        have += len(ids)
        if have >= need:
            break
    n = min(count, have // length)
    if n == 0:
        raise ValueError(f"data.validation_path={path} holds {have} tokens, fewer than one window of "
                         f"train.seq_len + 1 = {length}")
    return np.asarray(tokens[: n * length], np.int32).reshape(n, length)
