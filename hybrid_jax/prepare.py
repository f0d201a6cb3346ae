"""``python -m hybrid_jax.prepare``: raw documents -> token shards for ``data.source=tokens`` (or, with
``--format megatron``, Megatron-LM's ``PREFIX.bin/.idx`` for ``data.source=megatron`` and Megatron itself).

Example::

    python -m hybrid_jax.prepare --input 'fineweb/*.parquet' --tokenizer llama2/tokenizer.model \\
        --output /data/fineweb_llama2 --workers 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hybrid_jax.data.prepare import open_documents, prepare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid_jax.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True,
                   help="parquet/jsonl file or glob; tfds:NAME[/CONFIG]; or a Hugging Face dataset name")
    p.add_argument("--tokenizer", required=True,
                   help="SentencePiece .model, tiktoken BPE rank file, or HF tokenizer.json (or a directory)")
    p.add_argument("--output", required=True, help="directory for the shards and manifest.json")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: all)")
    p.add_argument("--limit-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    p.add_argument("--text-column", default="text")
    p.add_argument("--split", default="train", help="split of a tfds or Hugging Face dataset")
    p.add_argument("--tfds-data-dir", default=None, help="data_dir of a locally built TFDS dataset")
    p.add_argument("--hf-config", default=None, help="config of a Hugging Face dataset, e.g. sample-10BT")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard (whole documents)")
    p.add_argument("--format", choices=("tokens", "megatron"), default="tokens",
                   help="tokens: our shards + manifest.json in --output; megatron: Megatron-LM's indexed dataset, "
                        "--output being its path prefix (writes PREFIX.bin and PREFIX.idx)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        docs = open_documents(args.input, text_column=args.text_column, split=args.split,
                              tfds_data_dir=args.tfds_data_dir, hf_config=args.hf_config)
        m = prepare(docs, args.tokenizer, args.output, workers=args.workers, limit_docs=args.limit_docs,
                    force=args.force, shard_tokens=args.shard_tokens, source=args.input, output_format=args.format)
    except (FileExistsError, FileNotFoundError, ImportError, ValueError) as e:  # the message says what to do
        raise SystemExit(f"error: {e}") from None
    if args.format == "megatron":
        print(f"note: Megatron's format records no tokenizer: train with --config.data.source=megatron "
              f"--config.data.path={args.output} --config.data.tokenizer={m['tokenizer']['path']}", file=sys.stderr)
    if m["null_texts_skipped"]:
        print(f"note: {m['null_texts_skipped']} documents with a null text were left out", file=sys.stderr)
    summary = {k: m[k] for k in ("num_documents", "num_tokens", "vocab_size", "eos_id", "seconds")}
    summary["tokens_per_second"] = m["num_tokens"] / m["seconds"]
    summary["shards"] = len(m["shards"])
    summary["null_texts_skipped"] = m["null_texts_skipped"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
