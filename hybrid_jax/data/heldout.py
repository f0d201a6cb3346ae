"""Held-out windows for the validation loss: a fixed ``[n, seq_len + 1]`` int32 array, the same at every evaluation.

``data.validation_path`` is one of

* a token dataset, ours (a prepared directory: checked to be prepared with the run's tokenizer, same sha256, and to
  fit ``model.vocab_size``) or a Megatron ``.bin/.idx`` path prefix: its first windows, in order; or a blend of them
  (``"0.7 a 0.3 b"``): each dataset's first windows in order, interleaved by weight as the training blend is;
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

from hybrid_jax.data.blend import open_blend
from hybrid_jax.data.megatron import IDX
from hybrid_jax.data.mock import MarkovSequences
from hybrid_jax.data.pipeline import Batch, segment_ids_after_eos
from hybrid_jax.data.run_tokenizer import RunTokenizer
from hybrid_jax.data.source import TokenWindows
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
    if len(path.split()) > 1 or p.is_dir() or Path(f"{p}{IDX}").is_file():
        return _dataset_windows(config, path, length, count, tokenizer)
    if not p.is_file():
        raise FileNotFoundError(f"data.validation_path={path} not found: give a prepared dataset directory, a "
                                "Megatron dataset's path prefix, a blend, a .jsonl/.parquet file of documents, or "
                                "'mock'")
    if not p.name.endswith(DOCUMENT_SUFFIXES):
        raise ValueError(f"data.validation_path={path}: expected a .jsonl(.gz) or .parquet file of documents, a "
                         "prepared dataset directory or a Megatron dataset's path prefix")
    windows, eos_id = _document_windows(config, p, length, count, tokenizer)
    if not config.data.document_mask:
        return Batch(windows)
    return Batch(windows, np.stack([segment_ids_after_eos(w, eos_id) for w in windows]))


def _dataset_windows(config: ConfigDict, path: str, length: int, count: int,
                     tokenizer: RunTokenizer | None) -> Batch:
    """The first windows of a dataset or blend, in order (a blend's interleaved by weight), fewer when one of its
    datasets runs out."""
    blend = open_blend(path, config.data.source, key="data.validation_path")
    for source in blend.sources:
        if source.vocab_size is not None:
            check_vocab(config.model.vocab_size, source.vocab_size, what=f"the tokenizer of {source.path}")
        recorded = source.tokenizer
        if tokenizer is not None and recorded is not None and tokenizer.sha256 != recorded.get("sha256"):
            raise ValueError(f"data.validation_path={source.path} was prepared with {recorded.get('path')}, not with "
                             f"the run's tokenizer {tokenizer.path}: prepare it with the same tokenizer")
    windows = [TokenWindows(s, length, config.model.vocab_size) for s in blend.sources]
    schedule, rows = blend.schedule(), []
    for i in range(count):
        d, j = schedule[i]
        if j >= len(windows[d]):
            break
        rows.append((d, j))
    tokens = np.stack([windows[d][j] for d, j in rows])
    if not config.data.document_mask:
        return Batch(tokens)
    return Batch(tokens, np.stack([windows[d].segment_ids(j) for d, j in rows]))


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
