"""Issue 50's training figures in one command, against their MFU goals: one record ``mfu_goals``.

    python -m benchmarks mfu_goals --fineweb DATA [--steps 10] [--warmup 2] [--only NAME ...] [--timeout 900]
    python -m benchmarks mfu_goals --collect DIR      # the record from the train records already in DIR

Each figure is ``python -m benchmarks train`` (``benchmarks/train_throughput.py``) on one GPU, in a process of its
own (one after the other: each takes the GPU's memory), its record ``mfu_<NAME>.json`` kept under ``$OUT/mfu_goals``.
The figures (:data:`FIGURES`): 300M GDN on mock data and on a prepared FineWeb (``--fineweb``, Llama-3 tokens, the
config's vocabulary), 300M KDA, the 300M GDN and Mamba2 hybrids (micro batch 32 x 2048), 1B GDN at micro batch 16,
and the 3B at 8192 tokens (its config's micro batch 4 and ``model.remat=dots``, or ``--3b-micro-batch``,
``--3b-remat``). The record ``mfu_goals`` holds per figure ``mfu`` (a fraction), ``tokens_per_s``,
``peak_memory_gib``, ``micro_batch_size``, its ``goal``, whether it is ``met`` and ``step_s_halves`` (the mean step
time of each half of the timed steps: about equal when steady), and ``fineweb_over_mock`` (goal: within 1%). A figure
that fails or is skipped is named with why; the others stay.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from benchmarks import record
from benchmarks.processes import run_process
from hybrid_jax.model.plan import REMAT_MODES

# name: (config, its overrides, MFU goal)
FIGURES: dict[str, tuple[str, tuple[str, ...], float]] = {
    "300m_gdn_mock": ("zebra_300m_gdn", (), 0.50),
    "300m_gdn_fineweb": ("zebra_300m_gdn", ("--config.data.source=tokens",), 0.50),
    "300m_kda_mock": ("zebra_300m_kda", (), 0.50),
    "300m_gdn_hybrid": ("zebra_300m_gdn_hybrid", (), 0.48),
    "300m_mamba2_hybrid": ("zebra_300m_mamba2_hybrid", (), 0.48),
    "1b_gdn": ("zebra_1b_gdn", ("--config.train.micro_batch_size=16",), 0.57),
    "3b_8192": ("zebra_3b", ("--config.train.seq_len=8192",), 0.45),
}
FINEWEB_WITHIN = 0.01  # FineWeb's tokens/s within 1% of mock's
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def train_command(name: str, args: argparse.Namespace, out: pathlib.Path) -> list[str]:
    """The ``python -m benchmarks train`` command of figure ``name``."""
    config, overrides, _ = FIGURES[name]
    extra = list(overrides)
    if name == "300m_gdn_fineweb":
        extra.append(f"--config.data.path={args.fineweb}")
    if name == "3b_8192":
        if args.micro_batch_3b is not None:
            extra.append(f"--config.train.micro_batch_size={args.micro_batch_3b}")
        if args.remat_3b is not None:
            extra.append(f"--config.model.remat={args.remat_3b}")
    return [sys.executable, "-m", "benchmarks", "train", "--config", str(CONFIGS / f"{config}.py"), "--steps",
            str(args.steps), "--warmup", str(args.warmup), "--name", f"mfu_{name}", "--out", str(out), *extra]


def collect(directory: pathlib.Path, names: list[str], notes: dict[str, str]) -> dict:
    """The ``mfu_goals`` figures from ``directory``'s ``mfu_<NAME>.json`` train records; a missing one is named in
    ``notes`` (or keeps the note it has)."""
    figures: dict = {}
    for name in names:
        path = directory / f"mfu_{name}.json"
        if not path.exists():
            notes.setdefault(name, f"no record {path.name}")
            continue
        r = record.load(path)["figures"]
        goal = FIGURES[name][2]
        figures[name] = dict(mfu=r["mfu"], tokens_per_s=r["tokens_per_s"], peak_memory_gib=r["peak_memory_gib"],
                             micro_batch_size=r["micro_batch_size"], seq_len=r["seq_len"], remat=r["remat"],
                             goal=goal, met=r["mfu"] is not None and r["mfu"] >= goal)
        if r.get("step_s_halves"):  # the timed steps' two halves (records since they were timed so)
            figures[name]["step_s_halves"] = r["step_s_halves"]
    mock, fineweb = figures.get("300m_gdn_mock"), figures.get("300m_gdn_fineweb")
    if mock and fineweb:
        ratio = fineweb["tokens_per_s"] / mock["tokens_per_s"]
        figures["fineweb_over_mock"] = dict(ratio=ratio, met=abs(ratio - 1) <= FINEWEB_WITHIN)
    if notes:
        figures["not_measured"] = notes
    return figures


def line(name: str, f: dict) -> str:
    """One figure as a log line."""
    if name == "fineweb_over_mock":
        return f"{name}: {f['ratio']:.3f} (goal within {FINEWEB_WITHIN:.0%}: {'met' if f['met'] else 'NOT met'})"
    mfu = "-" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
    peak = "-" if f["peak_memory_gib"] is None else f"{f['peak_memory_gib']:.1f}"
    return (f"{name}: {f['tokens_per_s']:,.0f} tokens/s, MFU {mfu} (goal {100 * f['goal']:.0f}%: "
            f"{'met' if f['met'] else 'NOT met'}), peak {peak} GiB, micro batch {f['micro_batch_size']} x "
            f"{f['seq_len']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks mfu_goals", description=__doc__.splitlines()[0])
    ap.add_argument("--fineweb", default=None, help="a prepared FineWeb folder (python -m hybrid_jax.prepare, Llama-3 "
                                                     "tokens) for 300m_gdn_fineweb (without it: skipped)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per figure")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    ap.add_argument("--only", nargs="+", choices=list(FIGURES), help="these figures only")
    ap.add_argument("--3b-micro-batch", dest="micro_batch_3b", type=int, default=None,
                    help="the 3B's micro batch (default: its config's, 4)")
    ap.add_argument("--3b-remat", dest="remat_3b", default=None, choices=REMAT_MODES,
                    help="model.remat of the 3B (default: its config's, dots)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per figure")
    ap.add_argument("--collect", default=None, metavar="DIR", help="only build the record from DIR's train records")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv)
    names = args.only or list(FIGURES)
    notes: dict[str, str] = {}
    if args.collect:
        directory = pathlib.Path(args.collect)
        if not directory.is_dir():
            ap.error(f"--collect {directory}: no such folder")
    else:
        if args.fineweb is not None and not (pathlib.Path(args.fineweb) / "manifest.json").exists():
            ap.error(f"--fineweb {args.fineweb}: no prepared token folder there (python -m hybrid_jax.prepare writes "
                     "one, with its manifest.json)")
        directory = record.out_dir(args.out) / "mfu_goals"
        directory.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name == "300m_gdn_fineweb" and args.fineweb is None:
                notes[name] = "skipped: no --fineweb"
                continue
            cmd = train_command(name, args, directory)
            print(f"=== {name}: {' '.join(cmd[2:])}", flush=True)
            rc = run_process(cmd, timeout=args.timeout, quiet=True)
            if rc != 0:
                notes[name] = f"failed: {rc}"
    figures = collect(directory, names, notes)
    for name, f in figures.items():
        print(line(name, f) if name != "not_measured" else f"not measured: {json.dumps(f)}", flush=True)
    record.save("mfu_goals", figures, out=args.out)


if __name__ == "__main__":
    main()
