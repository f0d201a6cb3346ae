"""Training throughput of two or more trees, alternating in one command: whether a change pays, beside the tree
before it.

    git archive BEFORE | tar -x -C /tmp/before
    python -m benchmarks train_ab --config configs/zebra_300m_gdn.py --tree before=/tmp/before --tree after=. \
        [--rounds 2] [--steps 10] [--warmup 2] [--timeout 300] [-- --config.train.micro_batch_size=16 ...]

Each round runs ``python -m benchmarks train`` once per tree, in the order given, each in a process of its own
started in that tree with its ``hybrid_jax`` and ``benchmarks`` first on the path: each tree is timed with its own
code, config file and harness, and the GPU's drift hits all trees alike. ``--tree NAME=DIR@COMMIT`` names the commit
the copy holds (a ``git archive`` copy has no ``.git``); without it the tree's git says. Arguments after ``--`` go to
every run. The record ``train_ab_<config>`` holds per tree each round's tokens/s, their median, MFU, peak memory
and last loss, and per tree after the first the median tokens/s over the first tree's (``over_first``). A run that
fails is named with why; the others stay.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys

from benchmarks import record
from benchmarks.processes import run_process


@dataclasses.dataclass(frozen=True)
class Tree:
    name: str
    path: pathlib.Path
    commit: str


def parse_tree(spec: str) -> Tree:
    """``NAME=DIR`` or ``NAME=DIR@COMMIT`` (a ValueError for anything else)."""
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise ValueError(f"--tree {spec!r}: expected NAME=DIR or NAME=DIR@COMMIT")
    path, _, commit = where.partition("@")
    path = pathlib.Path(path).resolve()
    return Tree(name, path, commit or record.git_head(path)[0][:7])


def train_command(tree: Tree, args: argparse.Namespace, round_: int, out: pathlib.Path) -> list[str]:
    """The ``python -m benchmarks train`` command of ``tree``'s run in round ``round_``."""
    return [sys.executable, "-m", "benchmarks", "train", "--config", args.config, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--name", f"{tree.name}_{round_}", "--out", str(out), *args.overrides]


def tree_env(tree: Tree) -> dict[str, str]:
    """The environment of ``tree``'s runs: its folder first on the path (not the current directory's installed
    tree), its commit for the record."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree.path), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["BENCH_COMMIT"] = tree.commit
    return env


def run_train(cmd: list[str], tree: Tree, timeout: float) -> int | str:
    """Run ``cmd`` in ``tree``: its exit status, or why it stopped."""
    return run_process(cmd, timeout=timeout, cwd=tree.path, env=tree_env(tree), quiet=True)


def collect(trees: list[Tree], rounds: int, out: pathlib.Path, failed: dict[str, str]) -> dict:
    """The record's figures from the train records ``<tree>_<round>.json`` in ``out``."""
    figures: dict = {}
    for tree in trees:
        runs = []
        for r in range(1, rounds + 1):
            path = out / f"{tree.name}_{r}.json"
            if path.exists():
                runs.append(record.load(path)["figures"])
            else:
                failed.setdefault(f"{tree.name}_{r}", "no record")
        if not runs:
            continue
        speeds = [f["tokens_per_s"] for f in runs]
        mfu = [f["mfu"] for f in runs if f.get("mfu") is not None]
        figures[tree.name] = dict(commit=tree.commit, tokens_per_s=speeds,
                                  median_tokens_per_s=statistics.median(speeds),
                                  mfu=statistics.median(mfu) if mfu else None,
                                  peak_memory_gib=max(f["peak_memory_gib"] or 0 for f in runs) or None,
                                  loss_last=runs[-1]["loss_last"])
    first = figures.get(trees[0].name)
    for tree in trees[1:]:
        if first and tree.name in figures:
            figures[tree.name]["over_first"] = figures[tree.name]["median_tokens_per_s"] / first["median_tokens_per_s"]
    if failed:
        figures["failed"] = failed
    return figures


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m benchmarks train_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the config file, relative to each tree (configs/*.py)")
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR[@COMMIT], two or more; the first is "
                                                                   "the baseline")
    ap.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.overrides = overrides
    try:
        trees = [parse_tree(spec) for spec in args.tree]
    except ValueError as e:
        ap.error(str(e))
    if len(trees) < 2 or len({t.name for t in trees}) < len(trees):
        ap.error("--tree: give two or more trees with different names")
    for tree in trees:
        if not (tree.path / args.config).is_file():
            ap.error(f"--tree {tree.name}: no {args.config} in {tree.path}")
        if not (tree.path / "benchmarks" / "train_throughput.py").is_file():
            ap.error(f"--tree {tree.name}: {tree.path} is not a checkout of this project (no benchmarks/)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    out = record.out_dir(args.out) / "train_ab"
    out.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    for r in range(1, args.rounds + 1):
        for tree in trees:
            cmd = train_command(tree, args, r, out)
            print(f"=== round {r}, {tree.name} ({tree.commit}): {' '.join(cmd[2:])}", flush=True)
            rc = run_train(cmd, tree, args.timeout)
            if rc != 0:
                failed[f"{tree.name}_{r}"] = f"failed: {rc}"
    figures = collect(trees, args.rounds, out, failed)
    for tree in trees:
        f = figures.get(tree.name)
        if f:
            ratio = f" ({f['over_first']:.3f}x {trees[0].name})" if "over_first" in f else ""
            peak = "-" if f["peak_memory_gib"] is None else f"{f['peak_memory_gib']:.1f}"
            print(f"{tree.name}: {f['median_tokens_per_s']:,.0f} tokens/s{ratio}, peak {peak} GiB, "
                  f"loss {f['loss_last']:.4f}", flush=True)
    config = pathlib.Path(args.config).stem
    record.save(f"train_ab_{config}", figures, out=args.out)


if __name__ == "__main__":
    main()
