"""Held-out windows for the validation loss: a fixed ``[n, seq_len + 1]`` int32 array, the same at every evaluation.

``data.validation_path`` is one of

* a prepared dataset directory (``python -m hybrid_jax.prepare --output``): its first windows, in order, after
  checking it was prepared with the run's tokenizer (same sha256) and fits ``model.vocab_size``;
* a ``.jsonl(.gz)`` / ``.parquet`` file of documents (``text`` column): tokenized here with the run's tokenizer,
  each document followed by EOS, joined and cut into windows (like the training stream, unshuffled);
* ``"mock"`` (mock-data runs): Markov-chain sequences at indices far beyond any training stream's.

The windows are taken in order from the start, never shuffled, so every evaluation (and a resumed run's) scores
exactly the same tokens. With ``data.document_mask`` the segment ids come with them, as in the training batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.data.mock import MarkovSequences
from hybrid_jax.data.pipeline import Batch, segment_ids_after_eos
from hybrid_jax.data.run_tokenizer import RunTokenizer
from hybrid_jax.data.shards import TokenWindows, open_dataset
from hybrid_jax.data.tokenizer import check_vocab

MOCK_OFFSET = 2**62  # mock validation sequences start here; training reads indices from 0 upwards
DOCUMENT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


def heldout_windows(config: ConfigDict, count: int, tokenizer: RunTokenizer | None) -> Batch:
    """Up to ``count`` windows of ``train.seq_len + 1`` tokens of ``data.validation_path`` (fewer if it is short),
    with their segment ids under ``data.document_mask``. ``tokenizer``: the run's (needed for a documents file).
    Raises ValueError / FileNotFoundError with what to change."""
    path, length = config.data.validation_path, config.train.seq_len + 1
    if path == "mock":
        if config.data.document_mask:
            raise ValueError("data.validation_path='mock' does not support data.document_mask yet; validate on a "
                             "prepared dataset or a .jsonl of documents")
        chain = MarkovSequences(config.model.vocab_size, length, config.train.seed)
        return Batch(np.stack([chain(MOCK_OFFSET + i) for i in range(count)]))
    p = Path(path).expanduser()
    if p.is_dir():
        windows, eos_id = _prepared_windows(config, p, length, count, tokenizer)
    elif not p.is_file():
        raise FileNotFoundError(f"data.validation_path={path} not found: give a prepared dataset directory, a "
                                ".jsonl/.parquet file of documents, or 'mock'")
    elif not p.name.endswith(DOCUMENT_SUFFIXES):
        raise ValueError(f"data.validation_path={path}: expected a .jsonl(.gz) or .parquet file of documents or a "
                         "prepared dataset directory")
    else:
        windows, eos_id = _document_windows(config, p, length, count, tokenizer)
    if not config.data.document_mask:
        return Batch(windows)
    return Batch(windows, np.stack([segment_ids_after_eos(w, eos_id) for w in windows]))


def _prepared_windows(config: ConfigDict, directory: Path, length: int, count: int,
                      tokenizer: RunTokenizer | None) -> tuple[np.ndarray, int]:
    dataset = open_dataset(directory)
    check_vocab(config.model.vocab_size, dataset.vocab_size, what=f"the tokenizer of {directory}")
    if tokenizer is not None and tokenizer.sha256 != dataset.tokenizer.get("sha256"):
        raise ValueError(f"data.validation_path={directory} was prepared with {dataset.tokenizer.get('path')}, not "
                         f"with the run's tokenizer {tokenizer.path}: prepare it with the same tokenizer")
    windows = TokenWindows(dataset, length, config.model.vocab_size)
    return np.stack([windows[i] for i in range(min(count, len(windows)))]), dataset.eos_id


def _document_windows(config: ConfigDict, path: Path, length: int, count: int,
                      tokenizer: RunTokenizer | None) -> tuple[np.ndarray, int]:
    from hybrid_jax.data.prepare import open_documents

    if tokenizer is None:
        raise ValueError(f"data.validation_path={path} holds documents but the run has no tokenizer to encode them "
                         "with: set data.tokenizer (or train on prepared tokens whose manifest names one)")
    tok = tokenizer.load()
    check_vocab(config.model.vocab_size, tok.vocab_size)
    need, tokens, have = count * length, [], 0
    for text in open_documents(str(path)).texts:
        ids = tok.encode(text or "") + [tok.eos_id]
        tokens.extend(ids)
        have += len(ids)
        if have >= need:
            break
    n = min(count, have // length)
    if n == 0:
        raise ValueError(f"data.validation_path={path} holds {have} tokens, fewer than one window of "
                         f"train.seq_len + 1 = {length}")
    return np.asarray(tokens[: n * length], np.int32).reshape(n, length), tok.eos_id
