"""The command: arguments checked in one line each, the sweep of every kernel under a progress bar, the whole ops
timed, the tuning file written, a table of built-in against tuned times."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import jax

from hybrid_jax.kernels import tuning, tuning_file
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.sweep import Search, failure_note, sweep
from hybrid_jax.kernels.tuning import RecurrentConfig
from hybrid_jax.model.kernel_calls import published_configs
from hybrid_jax.tune.problems import TuneError, fit_batch, tuning_problems

PROG = "python -m hybrid_jax.tune"
_DOC = "Sweep the recurrent kernels' launches on this GPU at a config's shapes and write a tuning file."


def _changes(cfg: RecurrentConfig, base: RecurrentConfig) -> str:
    diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(base, f.name)]
    return ", ".join(diff).replace("Launch(num_warps=", "(").replace(" num_stages=", " ") or "(built-in)"


def check_out(path: Path) -> None:
    """A :class:`TuneError` unless ``path`` can be written (its nearest existing folder is writable)."""
    if path.is_dir():
        raise TuneError(f"--out {path}: is a folder, give a file path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise TuneError(f"--out {path}: cannot be written ({parent} is not a writable folder)")



def _parse(argv):
    ap = argparse.ArgumentParser(prog=PROG, description=_DOC)
    ap.add_argument("--config", action="append", help="a run config (configs/X.py; repeatable); default: every "
                    "configs/zebra_*.py")
    ap.add_argument("--budget-s", type=float, default=600.0, help="seconds of sweep, split across the kernels")
    ap.add_argument("--out", help="where the tuning file goes (default: this GPU's, which model.tuning=auto uses)")
    ap.add_argument("--batch", type=int, help="batch cap (default 8; interpret mode 1)")
    ap.add_argument("--seq-len", type=int, help="sequence length (default the config's; interpret mode 64)")
    ap.add_argument("--repeats", type=int, help="timing samples per measurement (default 10; interpret mode 3)")
    ap.add_argument("--start", choices=("builtin", "fallback"), default="builtin",
                    help="where the search starts: this GPU's built-in entry (default) or the 'fallback' table's, "
                    "as on a GPU outside the tables; the file keeps the fastest of winner, start and built-in")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode at tiny shapes, to test the tool "
                    "(needs --out; on CPU the kernels do not run, so there is nothing to tune otherwise)")
    return ap.parse_args(argv)


def plan(args) -> tuple[dict[tuple[str, int, int], list[tuple[Problem, list[str]]]], Path, bool]:
    """Check the arguments (a :class:`TuneError` on bad input) -> (problems by tuning-file key with the config names
    that have them, the output path, interpret mode)."""
    from hybrid_jax.config import load_config_file

    if not args.budget_s > 0:
        raise TuneError(f"--budget-s must be positive, got {args.budget_s:g}")
    for flag in ("batch", "seq_len", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise TuneError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    paths = [Path(c) for c in args.config] if args.config else published_configs()
    if not paths:
        raise TuneError("no configs/zebra_*.py here: pass --config configs/X.py")
    for path in paths:
        if not path.is_file():
            raise TuneError(f"--config {path}: no such file")
    interpret = args.interpret
    if jax.default_backend() == "cpu" and not interpret:
        raise TuneError("the Pallas kernels do not run on cpu (training there uses their XLA form): nothing to tune, "
                        "nothing written; run this on the GPU you train on (--interpret --out FILE exercises the tool "
                        "itself in Pallas interpret mode)")
    if interpret and not args.out:
        raise TuneError("--interpret needs --out FILE: interpreter timings never become this machine's tuning file")
    out = Path(args.out) if args.out else tuning_file.cache_path()
    check_out(out)
    stats = jax.devices()[0].memory_stats() or {}
    by_key: dict[tuple[str, int, int], dict[Problem, list[str]]] = {}
    for path in paths:
        try:
            cfg = load_config_file(path)
        except Exception as e:  # noqa: BLE001 - said in one line
            raise TuneError(f"--config {path}: cannot be loaded ({type(e).__name__}: {e})") from None
        found = tuning_problems(cfg, args.batch or (1 if interpret else 8), args.seq_len or (64 if interpret else None),
                            2 if interpret else None, "float32" if interpret else "bfloat16")
        if not found and args.config:
            raise TuneError(f"--config {path}: no recurrent mixer in its plan (nothing to tune)")
        for p in found:
            by_key.setdefault(p.key, {}).setdefault(fit_batch(p, stats.get("bytes_limit")), []).append(path.stem)
    return {k: list(v.items()) for k, v in by_key.items()}, out, interpret


def main(argv: list[str] | None = None) -> Path:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    args = _parse(argv)
    try:
        by_key, out, interpret = plan(args)
    except TuneError as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    console, t0 = Console(), time.perf_counter()
    end = t0 + args.budget_s
    repeats = args.repeats or (3 if interpret else 10)
    arch, kind = tuning.current_arch(), jax.devices()[0].device_kind
    mode = ", interpret mode" if interpret else ""
    console.print(f"tuning {len(by_key)} kernels on {kind} (built-in table {arch}{mode})"
                  f" within {args.budget_s:g} s: {', '.join(f'{op} K{K} V{V}' for op, K, V in by_key)}")
    notes: list[str] = []
    searches, builtins, best = [], [], {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("preparing inputs", total=None)
        for (op, K, V), entries in by_key.items():
            problems = [p for p, _ in entries]
            start = tuning.recurrent_config(arch=arch if args.start == "builtin" else "fallback", per_key=op == "kda",
                                            op=op, dims=(K, V))
            chunks = sorted({p.chunk for p in problems if p.chunk})
            if len(chunks) > 1:
                notes.append(f"{op} K{K} V{V}: configs set chunk sizes {chunks}: tuned at {chunks[0]}")
            start = dataclasses.replace(start, chunk=chunks[0]) if chunks else start
            searches.append(Search(problems, start, interpret=interpret, repeats=repeats))
            builtins.append(dataclasses.replace(tuning.recurrent_config(arch=arch, per_key=op == "kda", op=op,
                                                                        dims=(K, V)), chunk=start.chunk))
        totals = [sum(len(a.values) - 1 for a in k.axes()) for k in searches]
        progress.update(task, total=sum(totals), completed=0)
        done = 0
        for i, (search, total) in enumerate(zip(searches, totals, strict=True)):
            op, K, V = search.key
            name = f"{op} K{K} V{V}"

            def note(text, name=name):
                notes.append(f"{name} {text}")
                progress.console.print(f"  {name} {text}", markup=False, highlight=False)

            progress.update(task, description=name)
            deadline = time.perf_counter() + (end - time.perf_counter()) / (len(searches) - i)
            best[search.key] = sweep(search, deadline, note, lambda n=1: progress.advance(task, n))
            done += total
            progress.update(task, completed=done)
    console.print(f"sweep done after {time.perf_counter() - t0:.0f} s; timing the whole ops (forward + backward)")
    from_fallback = args.start == "fallback"
    columns = ["op", "K", "V", "shapes", *(["fallback ms"] if from_fallback else []), "built-in ms", "tuned ms",
               "speed-up", *(["gap closed"] if from_fallback else []), "tuned launches"]
    entries, table = [], Table(*columns)
    for search, builtin in zip(searches, builtins, strict=True):
        op, K, V = search.key
        winner = best[search.key]

        def say(text, name=f"{op} K{K} V{V}"):
            notes.append(f"{name}: {text}")
            console.print(f"  {notes[-1]}", markup=False, highlight=False)

        def whole_op_ms(cfg, what):
            try:
                why = search.check(cfg)
                if why:
                    say(f"the {what} fails the numerics check: {why}")
                return search.op_ms(cfg)
            except Exception as e:  # noqa: BLE001 - said, never a crash
                say(f"the {what} does not run as a whole op: {failure_note(e)}")
                return math.inf

        times = {}  # config -> whole-op ms, each timed once
        for cfg, what in ((builtin, "built-in entry"), (search.start, "fallback entry"), (winner, "winner")):
            if cfg not in times:
                times[cfg] = whole_op_ms(cfg, what)
        builtin_ms, start_ms, tuned_ms = times[builtin], times[search.start], times[winner]
        keep = min(times, key=times.get)
        if times[keep] == math.inf:
            say("no entry (nothing runs)")
            continue
        if keep != winner:
            say(f"the {'built-in' if keep == builtin else 'start'} entry is faster as a whole op "
                f"({times[keep]:.3f} ms vs the winner's {tuned_ms:.3f} ms): it is kept")
        finite = lambda ms: round(ms, 4) if ms < math.inf else None  # noqa: E731
        entries.append({"op": op, "K": K, "V": V, "config": keep, "tuned_ms": finite(times[keep]),
                        "builtin_ms": finite(builtin_ms), "winner_ms": finite(tuned_ms),
                        **({"fallback_ms": finite(start_ms)} if from_fallback else {})})
        shapes = "; ".join(f"B{p.B} T{p.T} H{p.H}/{p.HV} ({', '.join(names)})" for p, names in by_key[search.key])
        gap = start_ms - builtin_ms
        closed = [f"{(start_ms - tuned_ms) / gap:.0%}" if gap > 0 and math.isfinite(gap) else "no gap"]
        table.add_row(op, str(K), str(V), shapes, *([f"{start_ms:.3f}"] if from_fallback else []),
                      f"{builtin_ms:.3f}", f"{tuned_ms:.3f}", f"{builtin_ms / tuned_ms:.2f}x",
                      *(closed if from_fallback else []), _changes(winner, builtin))
    shapes = [dict(dataclasses.asdict(p), configs=names) for v in by_key.values() for p, names in v]
    path = tuning_file.write(out, recurrent=entries, extra={
        "shapes": shapes, "budget_s": args.budget_s, "start": args.start, "interpret": interpret, "notes": notes})
    console.print(table)
    console.print(f"wrote {path}", soft_wrap=True, markup=False, highlight=False)
    if path.resolve() == tuning_file.cache_path().resolve():
        console.print("the kernels now use it automatically (model.tuning=auto)")
    else:
        console.print(f"use it with --config.model.tuning={path} (model.tuning=auto reads "
                      f"{tuning_file.cache_path()})")
    return path


if __name__ == "__main__":
    main()
