"""Where a jitted step's device time goes: a summary of a ``jax.profiler`` trace (perfetto JSON).

    python3 -m benchmarks.trace_summary TRACE_DIR_OR_FILE [--top 30]

Reads ``perfetto_trace.json.gz`` (written by ``jax.profiler.trace(dir, create_perfetto_trace=True)``; found under
``TRACE_DIR`` when a directory is given), keeps the complete events of the device processes (``/device:...``;
on a CPU-only trace, the XLA executor threads of the host), and adds up their durations per event name: one row
per kernel or HLO op, with its share of the device's busy time, the call count and, when the event carries it, the
op's JAX name stack (``tf_op`` / ``long_name`` / ``hlo_op``), which says which layer it belongs to. Also a split by
category: our Pallas recurrent and attention kernels (by the names we give them), cuDNN, matmuls (GEMM / cuBLAS /
``dot``), collectives, and the rest (XLA fusions). ``benchmarks/train_throughput.py --profile DIR`` writes such a
trace of a few training steps and prints this summary.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

SCOPE_KEYS = ("tf_op", "long_name", "hlo_op")
OUR_KERNELS = ("wy_fwd", "state_fwd", "output_fwd", "state_bwd", "grad_bwd", "grad_wy_bwd", "flash_attention")
CATEGORIES = (  # (category, substrings of a lower-cased event name); the first match wins
    ("pallas recurrent", OUR_KERNELS[:6]),
    ("pallas attention", ("flash_attention",)),
    ("cudnn", ("cudnn",)),
    ("matmul", ("gemm", "cublas", "cutlass", "dot", "matmul", "sm90_xmma", "nvjet")),
    ("collective", ("all-reduce", "all_reduce", "allreduce", "all-gather", "reduce-scatter", "nccl", "rccl")),
)


def find_trace(path: str | Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path} (profile with create_perfetto_trace=True)")
    return found[-1]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other (XLA fusions, copies)"


def summarize(trace: str | Path, top: int = 30) -> dict:
    """``{"busy_ms", "source", "ops": [{name, ms, share, count, scope}], "categories": {cat: ms}}`` of a trace."""
    data = json.load(gzip.open(find_trace(trace)))
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in process.items() if name.startswith("/device:")}
    if device:  # one line per device op: prefer the "XLA Ops" lines when the trace has them (kernels repeat ops)
        ops_lines = {key for key, name in thread.items() if key[0] in device and "xla ops" in name.lower()}
        keep = (lambda e: (e["pid"], e.get("tid")) in ops_lines) if ops_lines else (lambda e: e["pid"] in device)
        source = "device XLA ops" if ops_lines else "device streams"
    else:
        executors = {key for key, name in thread.items() if name.startswith("tf_XLA")}
        source = "host XLA threads (no device in trace)"

        def keep(e):  # HLO ops only (they carry their op name), not the executor's own bookkeeping
            return (e["pid"], e.get("tid")) in executors and any(k in (e.get("args") or {}) for k in SCOPE_KEYS)
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    scope: dict[str, str] = {}
    for e in events:
        if e.get("ph") != "X" or not keep(e):
            continue
        name = e.get("name", "?")
        total[name] += float(e.get("dur", 0.0)) / 1e3
        count[name] += 1
        args = e.get("args") or {}
        for key in SCOPE_KEYS:
            if key in args and name not in scope:
                scope[name] = str(args[key])[:160]
    busy = sum(total.values())
    cats: dict[str, float] = collections.defaultdict(float)
    for name, ms in total.items():
        cats[category(f"{name} {scope.get(name, '')}")] += ms
    ops = [dict(name=n, ms=ms, share=ms / busy if busy else 0.0, count=count[n], scope=scope.get(n, ""))
           for n, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]]
    return dict(busy_ms=busy, source=source, ops=ops, categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])))


def format_summary(s: dict) -> str:
    lines = [f"device busy time {s['busy_ms']:.1f} ms ({s['source']})", "by category:"]
    lines += [f"  {cat:<30} {ms:9.2f} ms {100 * ms / max(s['busy_ms'], 1e-9):5.1f}%" for cat, ms in
              s["categories"].items()]
    lines.append(f"top {len(s['ops'])} ops:")
    lines += [f"  {o['ms']:9.2f} ms {100 * o['share']:5.1f}% x{o['count']:<5} {o['name'][:60]:<60} {o['scope'][:90]}"
              for o in s["ops"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a trace directory (jax.profiler.trace's log dir) or perfetto_trace.json.gz")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    print(format_summary(summarize(args.trace, args.top)))


if __name__ == "__main__":
    main()
