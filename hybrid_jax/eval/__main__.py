"""``python -m hybrid_jax.eval --workdir DIR --tasks arc_easy,arc_challenge,piqa [--limit N] [--batch-size B]``.

``--hf EXPORT_DIR`` scores an exported HF directory with lm-eval's ``hf`` model instead of the JAX model.
``--data-dir DIR`` (or ``HYBRID_JAX_EVAL_DATA``): local ARC/PIQA jsonl files for the bundled task YAMLs.
Results are printed and written as JSON next to the checkpoints (``WORKDIR/eval/step_<N>_jax.json``), or as
``EXPORT_DIR/eval_results.json`` with ``--hf``. ``--write-tasks DIR --data-dir DATA`` writes the local task YAMLs
for lm-eval's own CLI (``lm_eval --include_path DIR``) and prints the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid_jax.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", help="training run directory (the JAX model is scored unless --hf is given)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--hf", metavar="EXPORT_DIR", help="score this exported HF directory (lm-eval 'hf' model)")
    p.add_argument("--trust-remote-code", action="store_true", help="with --hf: run the directory's own modeling code "
                   "(our exports load with this package's code without it)")
    p.add_argument("--tasks", help="comma-separated lm-eval task names (required unless --write-tasks)")
    p.add_argument("--limit", type=int, default=None, help="documents per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--data-dir", default=None, help="directory with the local task data (ARC, PIQA jsonl)")
    p.add_argument("--write-tasks", metavar="DIR", help="write the local task YAMLs (for --data-dir) into DIR for "
                   "lm-eval's own CLI (--include_path DIR) and exit")
    args = p.parse_args(argv)
    if args.write_tasks:
        return args
    if not args.tasks:
        p.error("the following arguments are required: --tasks")
    if not args.workdir and not args.hf:
        p.error("give --workdir or --hf")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from hybrid_jax.eval.run import evaluate
    from hybrid_jax.quiet import quiet_absl

    quiet_absl()
    if args.write_tasks:
        from hybrid_jax.eval.run import DATA_ENV, local_task_dir

        data_dir = args.data_dir or os.environ.get(DATA_ENV)
        if not data_dir:
            sys.exit("error: --write-tasks needs --data-dir DIR (the ARC / PIQA jsonl files)")
        try:
            out = local_task_dir(data_dir, Path(args.write_tasks))
        except FileNotFoundError as e:
            sys.exit(f"error: {e}")
        print(f"wrote {', '.join(sorted(p.name for p in out.glob('*.yaml')))} to {out}; use them with\n"
              f"HF_DATASETS_OFFLINE=1 lm_eval --model hf --model_args pretrained=EXPORT_DIR,trust_remote_code=True,"
              f"dtype=float32 --include_path {out} --tasks arc_easy,piqa --batch_size 8")
        return

    try:
        record = evaluate(tasks=[t for t in args.tasks.split(",") if t], workdir=args.workdir, step=args.step,
                          hf_dir=args.hf, limit=args.limit, batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                          data_dir=args.data_dir, trust_remote_code=args.trust_remote_code)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    for task, metrics in record["results"].items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"{task}: {shown}")
    print(f"results written to {record['path']}")


if __name__ == "__main__":
    main()
