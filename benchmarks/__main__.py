"""One command for every benchmark: ``python -m benchmarks PART [flags]``, or several parts in one command.

    python -m benchmarks --help                      # the parts, one line each
    python -m benchmarks kernels --only gdn_anchor   # one part: benchmarks.kernels.main(["--only", "gdn_anchor"])
    python -m benchmarks PART --help                 # that part's typed flags
    python -m benchmarks run [--parallel] [--timeout S] 'PART FLAGS...' ['PART FLAGS...' ...]

``run`` runs each quoted part command in a process of its own (JAX and PyTorch must not share one: each takes the
GPU's memory), one after the other, so that ours and the reference are timed on the same GPU in one command, e.g.
``run 'kernels --only kda_anchor' 'fla_reference --only kda_anchor --no-attention'``. With ``--parallel`` part
``i`` runs on GPU ``i`` (``CUDA_VISIBLE_DEVICES=i``), all at once, its output in ``$OUT/run_<i>_<part>.log`` (one
part per GPU: two JAX processes on one GPU run out of memory). ``--timeout``: seconds per part.

Every part that reports numbers writes one record (``benchmarks/record.py``) under ``--out`` (default ``$OUT``,
else ``./bench_out``). On the GPU machine, ``benchmarks/device.sh`` installs the carried wheels and this tree and
then runs this command.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import shlex
import subprocess
import sys
import time

from benchmarks.processes import run_process
from benchmarks.record import out_dir

PARTS = {  # name: (module, one line)
    "kernels": ("benchmarks.kernels", "our recurrent kernels (GDN, KDA, GLA / SSD) at the shapes of "
                "benchmarks/shapes.py, fwd and fwd+bwd, checked against the XLA form"),
    "autotune": ("benchmarks.autotune", "a launch sweep of the recurrent kernels at given shapes (a tuning-table "
                 "entry)"),
    "kernel_resources": ("benchmarks.kernel_resources", "registers, spills and shared memory of every Pallas launch, "
                         "compiled offline for sm90 / gfx942 / gfx950 (no GPU needed)"),
    "fla_reference": ("benchmarks.fla_reference", "the reference: FLA's Triton kernels and PyTorch SDPA at the "
                      "shapes we time (no JAX in its process)"),
    "accuracy": ("benchmarks.accuracy", "bf16 error of our recurrent kernels and of FLA's on the same inputs, "
                 "against one float32 reference (two sides, two processes)"),
    "documents": ("benchmarks.documents", "packed documents: recurrent kernels and attention fwd+bwd with a document "
                  "boundary every N tokens against none"),
    "attention": ("benchmarks.attention", "causal attention: our Pallas flash kernel, cuDNN and impl='auto'"),
    "train": ("benchmarks.train_throughput", "training throughput of a config: tokens/s, MFU, peak memory "
              "(--profile: where the step's device time goes)"),
    "train_ab": ("benchmarks.train_ab", "training throughput of two or more trees (a change and the tree before it), "
                 "alternating in one command: one record with the ratios"),
    "mfu_goals": ("benchmarks.mfu_goals", "issue 50's training figures (300M, hybrids, 1B, 3B; mock and FineWeb) in "
                  "one command against their MFU goals: one record"),
    "max_batch": ("benchmarks.max_batch", "the largest micro-batch per config and remat mode: by compiles, or "
                  "by real steps (--steps)"),
    "plan_memory": ("benchmarks.plan_memory", "per-device memory of a config's train step at a data x fsdp mesh, "
                    "from the compiled step, no weights allocated (--cpu: on host devices)"),
    "norm_launches": ("benchmarks.norm_launches", "a launch sweep of the RMSNorm kernels (the residual add's, the "
                      "gated ones) at a config's shapes, beside the current launch: choosing NormConfig"),
    "small_ops": ("benchmarks.small_ops", "norms, SwiGLU, short conv and cross-entropy under XLA against the "
                  "memory / matmul roofline"),
    "embedding_grad": ("benchmarks.embedding_grad", "the token embedding's gradient on mock and on real text's ids: "
                       "the gather's transpose against the model's sorted lookup"),
    "context_shard": ("benchmarks.context_shard", "one context-parallel shard's recurrences and MLA attention against "
                      "the plain calls on its tokens, on one GPU: the extra work of the context axis"),
    "sublayers": ("benchmarks.sublayers", "time per sublayer kind against its FLOP share"),
    "decode": ("benchmarks.decode", "decoding: cache memory per token (--memory) and decode tokens/s"),
    "data_pipeline": ("benchmarks.data_pipeline", "prepare (tokens/s) and the Grain pipeline (batches/s), CPU"),
    "fla_parity": ("benchmarks.fla_parity", "FLA's own model classes on our export, and FLA's init in our trainer"),
    "loss_parity": ("benchmarks.loss_parity", "loss curves of our trainer and FLA (or our PyTorch export) over "
                    "200 steps from the same weights and batches"),
    "before_after": ("benchmarks.before_after", "our recurrent kernels and the loss kernel from another checkout "
                     "beside this tree's, in one process: time ratios and bitwise equality"),
    "anchor": ("benchmarks.anchors", "the reference's own anchor scripts (FLA training, FLA kernels), carried "
               "beside the tree"),
    "trace_summary": ("benchmarks.trace_summary", "where a profiler trace's device time goes, by JAX scope and op"),
}


def call_part(name: str, argv: list[str]) -> None:
    """``main(argv)`` of part ``name``'s module (a ``main()`` without arguments reads ``sys.argv``)."""
    module = importlib.import_module(PARTS[name][0])
    if inspect.signature(module.main).parameters:
        module.main(argv)
    else:
        sys.argv = [module.__file__, *argv]
        module.main()


def run(argv: list[str]) -> int:
    """The ``run`` part: several part commands, each in its own process."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks run", description=run.__doc__)
    ap.add_argument("commands", nargs="+", metavar="'PART FLAGS...'", help="one quoted part command each")
    ap.add_argument("--parallel", action="store_true", help="command i on GPU i, all at once")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per command (default: none)")
    args = ap.parse_args(argv)
    commands = [shlex.split(c) for c in args.commands]
    unknown = [c[0] for c in commands if c[0] not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; the parts: {', '.join(PARTS)}")
    python = [sys.executable, "-m", "benchmarks"]
    if not args.parallel:
        failed = 0
        for c in commands:
            print(f"=== {shlex.join(c)} {time.strftime('%H:%M:%S')}", flush=True)
            rc = run_process(python + c, timeout=args.timeout)
            if isinstance(rc, str):
                print(f"=== {c[0]}: {rc}", flush=True)
            failed += rc != 0
        return int(failed > 0)
    out, procs = out_dir(), []
    for i, c in enumerate(commands):
        log = open(out / f"run_{i}_{c[0]}.log", "w")  # noqa: SIM115 (closed below)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
        procs.append((c, log, subprocess.Popen(python + c, stdout=log, stderr=subprocess.STDOUT, env=env)))
    failed = 0
    for i, (c, log, proc) in enumerate(procs):
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timed out"
        log.close()
        print(f"=== GPU {i}: {shlex.join(c)}: exit {rc}, log {log.name}", flush=True)
        failed += rc != 0
    return int(failed > 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    width = max(map(len, PARTS))
    listing = "\n".join(f"  {name:<{width}}  {line}" for name, (_, line) in PARTS.items())
    listing += f"\n  {'run':<{width}}  several part commands in one command, one process each"
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0], epilog=f"parts:\n{listing}\n\n'python -m benchmarks PART --help' "
        "shows a part's flags.")
    ap.add_argument("part", choices=[*PARTS, "run"], metavar="PART", help="one of the parts below")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="the part's flags")
    args = ap.parse_args(argv)
    if args.part == "run":
        return run(args.flags)
    call_part(args.part, args.flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
