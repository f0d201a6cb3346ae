"""Raw documents -> token shards + manifest (the format of :mod:`hybrid_jax.data.shards`).

Sources (:func:`open_documents`), each yielding the ``text`` column (``--text-column``) of every row:

* a local parquet or jsonl(.gz) file, or a glob of them (read with pyarrow / json; never needs the network);
* ``tfds:NAME[/CONFIG]``: a locally built TFDS dataset read through tensorflow-datasets' random-access
  ``data_source`` (``--tfds-data-dir``; the dataset must be stored as array_record; TensorFlow is not needed);
* anything else is taken as a Hugging Face dataset name (e.g. ``HuggingFaceFW/fineweb-edu`` with
  ``--hf-config sample-10BT``), streamed with ``datasets`` (needs the network and ``pip install datasets``).

Documents are tokenized in worker processes (in document order, so the output does not depend on the
worker count), EOS is appended to each, and the tokens are appended to shards of about ``shard_tokens``
tokens. ``manifest.json`` is written last, by atomic rename: an interrupted run leaves no manifest and the
training pipeline refuses the directory. ``output_format="megatron"`` writes Megatron-LM's ``PREFIX.bin/.idx``
instead (:mod:`hybrid_jax.data.megatron`; the index last, likewise), so one tokenized copy serves both frameworks.
"""

from __future__ import annotations

import collections
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hybrid_jax.data.megatron import MegatronWriter, claim_prefix
from hybrid_jax.data.shards import FORMAT, MANIFEST, OFFSET_DTYPE, TOKEN_DTYPE, shard_name
from hybrid_jax.data.tokenizer import Tokenizer, detect_kind, file_sha256, load_tokenizer, resolve_path

DOCS_PER_TASK = 64  # documents sent to a worker at a time
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")


@dataclass
class Documents:
    """A stream of document texts."""

    texts: Iterator[str]
    total: int | None  # number of documents when the source knows it (for the progress bar)


def open_documents(
    spec: str,
    *,
    text_column: str = "text",
    split: str = "train",
    tfds_data_dir: str | None = None,
    hf_config: str | None = None,
) -> Documents:
    """The documents named by ``spec`` (see the module docstring)."""
    if spec.startswith("tfds:"):
        return _tfds_documents(spec.removeprefix("tfds:"), split, tfds_data_dir, text_column)
    paths = sorted(glob.glob(os.path.expanduser(spec)))
    if paths:
        return _file_documents(paths, text_column)
    if glob.has_magic(spec) or spec.endswith(_FILE_SUFFIXES):
        raise FileNotFoundError(f"no input file matches {spec!r}")
    return _hf_documents(spec, hf_config, split, text_column)


def _file_documents(paths: list[str], column: str) -> Documents:
    for p in paths:
        if not p.endswith(_FILE_SUFFIXES):
            raise ValueError(f"{p}: expected .parquet or .jsonl(.gz) files")
    total = None
    for p in paths:
        if p.endswith(".parquet"):
            _check_parquet_column(p, column)
    if all(p.endswith(".parquet") for p in paths):
        total = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    return Documents(itertools.chain.from_iterable(_read_file(p, column) for p in paths), total)


def _check_parquet_column(path: str, column: str) -> None:
    """A ValueError unless ``path`` has a string column ``column``."""
    schema = pq.ParquetFile(path).schema_arrow
    if column not in schema.names:
        raise ValueError(f"{path} has no column {column!r} (its columns: {', '.join(schema.names)}); "
                         "name the text column with --text-column")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"{path}: column {column!r} holds {kind}, not text; name the text column with --text-column")


def checked_texts(texts: Iterable[Any], source: str, nulls: list[int]) -> Iterator[str]:
    """``texts`` with null ones left out and counted in ``nulls[0]``; a ValueError for a text that is not a string."""
    for i, text in enumerate(texts):
        if text is None:
            nulls[0] += 1
            continue
        if not isinstance(text, str):
            raise ValueError(f"{source or 'the input'}: document {i} is a {type(text).__name__} ({text!r:.40}), "
                             "not text; name the text column with --text-column")
        yield text


def _read_file(path: str, column: str) -> Iterator[str]:
    if path.endswith(".parquet"):
        for batch in pq.ParquetFile(path).iter_batches(columns=[column], batch_size=1024):
            yield from batch.column(0).to_pylist()
        return
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1}); convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON object ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict) or column not in row:
                raise ValueError(f"{path}:{line_no} has no {column!r} field (set --text-column)")
            yield row[column]


def _tfds_documents(name: str, split: str, data_dir: str | None, column: str) -> Documents:
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("tfds: inputs need tensorflow-datasets: pip install 'hybrid-jax[data]'") from e
    source = tfds.data_source(name, split=split, data_dir=data_dir, try_gcs=False)

    def texts() -> Iterator[str]:
        for start in range(0, len(source), DOCS_PER_TASK):
            for row in source.__getitems__(range(start, min(start + DOCS_PER_TASK, len(source)))):
                text = row[column]
                yield text.decode("utf-8") if isinstance(text, bytes) else text

    return Documents(texts(), len(source))


def _hf_documents(name: str, config: str | None, split: str, column: str) -> Documents:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"{name!r} is not a local file, so it is taken as a Hugging Face dataset name, which needs "
            "`pip install datasets` and network access; pass a local parquet/jsonl file or glob instead"
        ) from e
    rows = datasets.load_dataset(name, config, split=split, streaming=True)
    return Documents((row[column] for row in rows), None)


# --- tokenization in worker processes ------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_documents(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Documents -> (their tokens joined, each followed by EOS: uint32 ``[sum(lengths)]``, lengths ``[n]``)."""
    tok = _worker_tokenizer
    docs = [tok.encode(t or "") + [tok.eos_id] for t in texts]
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    return np.fromiter(itertools.chain.from_iterable(docs), dtype=TOKEN_DTYPE, count=int(lengths.sum())), lengths


def _chunks(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(texts)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _ordered_map(pool: Pool, fn: Callable, items: Iterable, in_flight: int) -> Iterator:
    """``pool.imap(fn, items)`` reading ``items`` only ``in_flight`` tasks ahead (imap would read a whole stream)."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _ShardWriter:
    """Appends whole documents to ``shard-NNNNN.bin`` (tokens) and ``.idx`` (document end offsets)."""

    def __init__(self, directory: Path, shard_tokens: int):
        self.directory, self.shard_tokens = directory, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._files = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents (``tokens`` joined, ``lengths`` each), starting a new shard once one is full."""
        ends = np.cumsum(lengths)
        doc = start = 0
        while doc < lengths.size:
            if self._files is None or self.shards[-1]["num_tokens"] >= self.shard_tokens:
                self._open_next()
            shard = self.shards[-1]
            room = self.shard_tokens - shard["num_tokens"]
            stop = min(int(np.searchsorted(ends[doc:] - start, room)) + doc + 1, lengths.size)  # docs filling it
            tokens[start : ends[stop - 1]].tofile(self._files[0])
            (shard["num_tokens"] + ends[doc:stop] - start).astype(OFFSET_DTYPE).tofile(self._files[1])
            shard["num_tokens"] += int(ends[stop - 1] - start)
            shard["num_documents"] += stop - doc
            doc, start = stop, int(ends[stop - 1])

    def _open_next(self) -> None:
        self.close()
        name = shard_name(len(self.shards))
        self.shards.append(dict(tokens=f"{name}.bin", index=f"{name}.idx", num_tokens=0, num_documents=0))
        self._files = (open(self.directory / f"{name}.bin", "wb"), open(self.directory / f"{name}.idx", "wb"))

    def close(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None


def _claim_output(out: Path, force: bool) -> None:
    """Create ``out``; refuse a non-empty one unless ``force``, then delete this format's files (manifest first)."""
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.iterdir()):
        return
    if not force:
        raise FileExistsError(f"output directory {out} is not empty; pass --force to overwrite it")
    for name in (MANIFEST, MANIFEST + ".tmp"):
        (out / name).unlink(missing_ok=True)
    for f in itertools.chain(out.glob("shard-*.bin"), out.glob("shard-*.idx")):
        f.unlink()


def prepare(
    documents: Documents,
    tokenizer_path: str | Path,
    output: str | Path,
    *,
    workers: int = 1,
    limit_docs: int | None = None,
    force: bool = False,
    shard_tokens: int = 1 << 28,
    source: str = "",
    progress: bool = True,
    output_format: str = "tokens",
) -> dict[str, Any]:
    """Tokenize ``documents`` into ``output``; returns the manifest (plus ``seconds``, not stored).

    Null texts are left out (not made empty documents) and counted in the manifest's ``null_texts_skipped``; a
    text that is not a string is a ValueError naming the document.

    ``workers <= 1`` tokenizes in this process; more starts that many worker processes. ``output_format``:
    ``tokens`` (our shards in the directory ``output``) or ``megatron`` (``output`` is the path prefix; no manifest).
    """
    tokenizer_file = resolve_path(tokenizer_path).resolve()
    tokenizer = load_tokenizer(tokenizer_file)
    out = Path(output)
    megatron = output_format == "megatron"
    folder = out.parent if megatron else out
    created = not folder.exists()
    if megatron:
        claim_prefix(out, force)
    else:
        _claim_output(out, force)
    try:
        return _prepare(documents, tokenizer_file, tokenizer, out, megatron, workers=workers, limit_docs=limit_docs,
                        shard_tokens=shard_tokens, source=source, progress=progress)
    except BaseException:
        _remove_written(out, megatron, folder if created else None)
        raise


def _remove_written(out: Path, megatron: bool, created: Path | None) -> None:
    """Undo a failed prepare: the files it wrote, and the folder when it created it."""
    if megatron:
        for suffix in (".bin", ".idx", ".idx.tmp"):
            Path(f"{out}{suffix}").unlink(missing_ok=True)
    else:
        for path in itertools.chain(out.glob("shard-*"), out.glob(MANIFEST + "*")):
            path.unlink(missing_ok=True)
    if created is not None and created.is_dir() and not any(created.iterdir()):
        created.rmdir()


def _prepare(documents: Documents, tokenizer_file: Path, tokenizer: Tokenizer, out: Path, megatron: bool, *,
             workers: int, limit_docs: int | None, shard_tokens: int, source: str, progress: bool) -> dict[str, Any]:
    nulls = [0]
    texts, total = checked_texts(documents.texts, source, nulls), documents.total
    if limit_docs is not None:
        texts = itertools.islice(texts, limit_docs)
        total = limit_docs if total is None else min(total, limit_docs)

    start = time.perf_counter()
    writer = MegatronWriter(out, tokenizer.vocab_size) if megatron else _ShardWriter(out, shard_tokens)
    num_docs = num_tokens = 0
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer_file),))
        encoded = _ordered_map(pool, _encode_documents, _chunks(texts, DOCS_PER_TASK), in_flight=4 * workers)
    else:
        _init_worker(str(tokenizer_file))
        encoded = map(_encode_documents, _chunks(texts, DOCS_PER_TASK))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    try:
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("tokenizing", total=total)
            for tokens, lengths in encoded:
                writer.add(tokens, lengths)
                num_docs += lengths.size
                num_tokens += tokens.size
                bar.update(task, advance=lengths.size, description=f"tokenizing: {num_tokens:,} tokens")
    finally:
        writer.close()
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - start
    if num_docs == 0:
        nulls_note = f" ({nulls[0]} null texts)" if nulls[0] else ""
        raise ValueError(f"{source or 'the input'} has no documents{nulls_note}")

    if megatron:
        writer.finish()
    manifest = dict(
        format="megatron" if megatron else FORMAT,
        source=source,
        num_documents=num_docs,
        null_texts_skipped=nulls[0],  # rows whose text was null: left out, not made empty documents
        num_tokens=num_tokens,
        dtype=writer.dtype.name if megatron else TOKEN_DTYPE.name,
        tokenizer=dict(path=str(tokenizer_file), sha256=file_sha256(tokenizer_file), kind=detect_kind(tokenizer_file)),
        vocab_size=tokenizer.vocab_size,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        shards=[f"{out}.bin"] if megatron else writer.shards,
    )
    if megatron:  # the format has no place for the manifest: the summary is returned only
        return {**manifest, "seconds": seconds}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return {**manifest, "seconds": seconds}
