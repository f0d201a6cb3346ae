"""The reference's own anchor scripts (not in this tree: carried beside it, by default in ``.anchors/``), recorded.

    python -m benchmarks anchor fla_training.py 32 gdn [--dir .anchors] [--name fla_train_gdn] [--timeout 540]
    python -m benchmarks anchor fla_kernels.py

Runs ``python3 DIR/SCRIPT ARGS...`` in a process of its own (it imports PyTorch and FLA; no JAX here) with ``OUT``
set to a scratch folder, prints its output, and saves the record ``NAME`` (default: the script's stem and its
arguments): the script, its arguments, its exit status, the last lines it printed and every JSON file it wrote
(``fla_training.py`` writes its tokens/s and peak memory to ``fla_model.json``). Put it in one command with ours,
``python -m benchmarks run 'train --config configs/zebra_300m_gdn.py' 'anchor fla_training.py 32 gdn'``, so both
are timed on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import record

TAIL_LINES = 40


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks anchor", description=__doc__.split("\n\n")[0])
    ap.add_argument("script", help="the anchor script's file name in --dir")
    ap.add_argument("args", nargs="*", help="its arguments")
    ap.add_argument("--dir", default=".anchors", help="where the anchor scripts are (default .anchors)")
    ap.add_argument("--name", default="", help="the record's name (default: script stem and arguments)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds (default: none)")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = ap.parse_args(argv)
    script = Path(args.dir) / args.script
    if not script.is_file():
        ap.error(f"no anchor script {script}")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            proc = subprocess.run([sys.executable, str(script), *args.args], env=dict(os.environ, OUT=scratch),
                                  capture_output=True, text=True, timeout=args.timeout)
            status, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            status, output = "timed out", (e.stdout or b"").decode() + (e.stderr or b"").decode()
        print(output, flush=True)
        written = {p.name: json.loads(p.read_text()) for p in sorted(Path(scratch).glob("*.json"))}
    name = args.name or "_".join([Path(args.script).stem, *args.args])
    figures = dict(script=args.script, args=args.args, exit=status, written=written,
                   output_tail=output.splitlines()[-TAIL_LINES:])
    record.save(name, figures, out=args.out)
    if status != 0:
        sys.exit(f"anchor {args.script}: exit {status}")
