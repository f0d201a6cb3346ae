"""``python -m hybrid_jax.export``: checkpoints to PyTorch formats, and FLA checkpoints or our HF exports back.

    python -m hybrid_jax.export --workdir DIR [--step N] --out OUT_DIR [--format hf|fla] [--dtype fp32|bf16]
    python -m hybrid_jax.export --from-fla FLA_DIR --workdir DIR [--config configs/X.py]
    python -m hybrid_jax.export --from-hf HF_DIR --workdir DIR [--config configs/X.py]

The first writes safetensors + config.json (+ modeling_hybrid.py for ``hf``) + tokenizer files + README.md; ``fla``
works for pure GDN / pure KDA models only. The others write a step-0 checkpoint of the weights into DIR that
``python -m hybrid_jax.train`` resumes from; they print the train command, with the model keys that differ from
the config (``--config``, else ``base_config()``).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ml_collections import ConfigDict

from hybrid_jax.config import base_config, flat_items, load_config_file
from hybrid_jax.data.run_tokenizer import NoTokenizer
from hybrid_jax.export.tensors import ExportError
from hybrid_jax.model.plan import sublayer_kinds
from hybrid_jax.quiet import quiet_absl

SUBCONFIGS = ("gdn", "kda", "mamba2", "mla")  # model keys of one sublayer kind each


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid_jax.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="training run directory (holds checkpoints/ and config.json)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--out", help="export directory")
    p.add_argument("--format", default="hf", choices=("hf", "fla"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    source = p.add_mutually_exclusive_group()
    source.add_argument("--from-fla", metavar="FLA_DIR", help="import this FLA checkpoint into --workdir instead")
    source.add_argument("--from-hf", metavar="HF_DIR", help="import this HF export of ours into --workdir instead")
    p.add_argument("--config", help="with --from-fla / --from-hf: a config file (configs/*.py) for every key the "
                   "checkpoint does not set")
    args = p.parse_args(argv)
    if not (args.from_fla or args.from_hf or args.out):
        p.error("--out is required (or --from-fla / --from-hf to import)")
    return args


def overrides(model_cfg: ConfigDict, base: ConfigDict) -> list[str]:
    """``--config.model.KEY=VALUE`` for each model key of ``model_cfg`` that differs from ``base``'s, leaving out the
    sub-configs of sublayer kinds the model does not use (shell-quoted, sorted)."""
    used = set(sublayer_kinds(model_cfg))
    was = dict(flat_items(base))
    return sorted(f"--config.model.{key}={shlex.quote(str(value))}" for key, value in flat_items(model_cfg)
                  if was.get(key) != value and not (key.split(".")[0] in SUBCONFIGS and key.split(".")[0] not in used))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_absl()
    try:
        if args.from_fla or args.from_hf:
            base = load_config_file(args.config) if args.config else base_config()
            from hybrid_jax.export.imports import load_fla, load_hf, write_training_start

            source = args.from_hf or args.from_fla
            config = write_training_start(load_hf if args.from_hf else load_fla, source, args.workdir, base)
            against = "" if args.config else " (overrides against base_config(); import with --config C for C's)"
            print(f"imported {source} into {args.workdir} (step 0). Train from it with{against}:\n"
                  + " ".join(["python -m hybrid_jax.train --config", shlex.quote(args.config or "CONFIG"),
                              f"--config.train.workdir={shlex.quote(str(args.workdir))}",
                              *overrides(config.model, base.model)]))
            return
        from hybrid_jax.export.writer import export

        out = export(args.workdir, args.out, step=args.step, fmt=args.format, dtype=args.dtype)
        print(f"exported {args.workdir} ({args.format}, {args.dtype}) to {out}")
    except (ExportError, FileNotFoundError, FileExistsError, NoTokenizer) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
