"""``python -m hybrid_jax.export``: checkpoints to PyTorch formats, and FLA checkpoints back into a workdir.

    python -m hybrid_jax.export --workdir DIR [--step N] --out OUT_DIR [--format hf|fla] [--dtype fp32|bf16]
    python -m hybrid_jax.export --from-fla FLA_DIR --workdir DIR [--config configs/X.py]

The first writes safetensors + config.json (+ modeling_hybrid.py for ``hf``) + tokenizer files + README.md; ``fla``
works for pure GDN / pure KDA models only. The second writes a step-0 checkpoint of FLA's weights into DIR that
``python -m hybrid_jax.train`` resumes from (pass the printed model overrides to the trainer).
"""

from __future__ import annotations

import argparse
import sys

from hybrid_jax.config import load_config_file
from hybrid_jax.data.run_tokenizer import NoTokenizer
from hybrid_jax.export.tensors import ExportError
from hybrid_jax.quiet import quiet_absl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid_jax.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="training run directory (holds checkpoints/ and config.json)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--out", help="export directory")
    p.add_argument("--format", default="hf", choices=("hf", "fla"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--from-fla", metavar="FLA_DIR", help="import this FLA checkpoint into --workdir instead")
    p.add_argument("--config", help="with --from-fla: a config file (configs/*.py) for everything but the model shape")
    args = p.parse_args(argv)
    if not args.from_fla and not args.out:
        p.error("--out is required (or --from-fla to import)")
    return args


def _overrides(model_cfg) -> list[str]:
    flat = {"": model_cfg.to_dict()}
    out = []
    while flat:
        prefix, d = flat.popitem()
        for k, v in d.items():
            if isinstance(v, dict):
                flat[f"{prefix}{k}."] = v
            else:
                out.append(f"--config.model.{prefix}{k}={v}")
    return sorted(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_absl()
    try:
        if args.from_fla:
            from hybrid_jax.export.import_fla import import_fla

            base = load_config_file(args.config) if args.config else None
            config = import_fla(args.from_fla, args.workdir, base)
            print(f"imported {args.from_fla} into {args.workdir} (step 0). Train from it with:\n"
                  f"python -m hybrid_jax.train --config {args.config or 'CONFIG'} "
                  f"--config.train.workdir={args.workdir} " + " ".join(_overrides(config.model)))
            return
        from hybrid_jax.export.writer import export

        out = export(args.workdir, args.out, step=args.step, fmt=args.format, dtype=args.dtype)
        print(f"exported {args.workdir} ({args.format}, {args.dtype}) to {out}")
    except (ExportError, FileNotFoundError, FileExistsError, NoTokenizer) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
