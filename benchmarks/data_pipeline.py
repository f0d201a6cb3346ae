"""Throughput of the data path: ``prepare`` (tokens/s) and the Grain pipeline from prepared shards (batches/s).

    python -m benchmarks data_pipeline --input 'fineweb/*.parquet' --tokenizer llama2/tokenizer.model \\
        --output /tmp/fineweb_llama2 --seq-len 2048 --batch-size 64 --workers 0 2

Without ``--input`` it measures the pipeline on an existing ``--output``. Prints one JSON line per measurement and
saves them as the record ``data_pipeline``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import record
from hybrid_jax.config import base_config
from hybrid_jax.data import DataStream
from hybrid_jax.data.prepare import open_documents, prepare
from hybrid_jax.data.shards import read_manifest


def measure_pipeline(path: str, seq_len: int, batch_size: int, workers: int, steps: int) -> dict:
    """Batches/s and tokens/s of the training :class:`DataStream` over ``steps`` batches, after warm-up."""
    c = base_config()
    c.train.update(dict(seq_len=seq_len, global_batch_size=batch_size))
    c.data.update(dict(source="tokens", path=path, num_workers=workers))
    c.model.vocab_size = read_manifest(path)["vocab_size"]
    it = DataStream.open(c)
    for _ in range(max(2, 2 * workers)):  # warm-up: worker start, first reads
        next(it)
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
    seconds = time.perf_counter() - start
    it.close()
    return dict(what="pipeline", path=path, seq_len=seq_len, batch_size=batch_size, num_workers=workers,
                batches_per_s=steps / seconds, tokens_per_s=steps * batch.tokens.shape[0] * seq_len / seconds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks data_pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--input", help="documents to prepare first (parquet/jsonl glob); omit to reuse --output")
    p.add_argument("--tokenizer")
    p.add_argument("--output", required=True)
    p.add_argument("--prepare-workers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64, help="sequences per batch")
    p.add_argument("--workers", type=int, nargs="+", default=[0], help="data.num_workers values to measure")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = p.parse_args(argv)
    results = []
    if args.input:
        m = prepare(open_documents(args.input), args.tokenizer, args.output, workers=args.prepare_workers,
                    force=True, source=args.input, progress=False)
        results.append(dict(what="prepare", input=args.input, tokenizer=args.tokenizer,
                            workers=args.prepare_workers, documents=m["num_documents"], tokens=m["num_tokens"],
                            seconds=m["seconds"], tokens_per_s=m["num_tokens"] / m["seconds"]))
        print(json.dumps(results[-1]), flush=True)
    for workers in args.workers:
        results.append(measure_pipeline(args.output, args.seq_len, args.batch_size, workers, args.steps))
        print(json.dumps(results[-1]), flush=True)
    record.save("data_pipeline", {"measurements": results}, out=args.out)


if __name__ == "__main__":
    main()
