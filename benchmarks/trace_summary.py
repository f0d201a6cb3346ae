"""Where a jitted step's device time goes: a summary of a ``jax.profiler`` trace (perfetto JSON).

    python -m benchmarks trace_summary TRACE_DIR_OR_FILE [--hlo step_hlo.txt] [--top 30] [--args-sample FILE] \
        [--steps N] [--families]

Reads ``perfetto_trace.json.gz`` (written by ``jax.profiler.trace(dir, create_perfetto_trace=True)``; found under
``TRACE_DIR`` when a directory is given), keeps the complete events of the device processes (``/device:...``;
on a CPU-only trace, the XLA executor threads of the host), and adds up their durations per event name: one row
per kernel or HLO op, with its share of the device's busy time, the call count and its scope. Also a split by
category: our Pallas recurrent and attention kernels (by the names we give them), cuDNN, matmuls (GEMM / cuBLAS /
``dot``), collectives, and the rest (XLA fusions). With the HLO text, the time per op family of a train step (LM
head and loss, MLP matmuls, mixer projections, recurrent kernels, attention, norms, optimizer, copies ...) per
step of the ``--steps`` traced, with the TFLOP/s of the matmul families and the TB/s of the rest
(``benchmarks/op_families.py``; ``--families``: that table alone).

The scope comes from the step's optimized HLO text (``compiled.as_text()``; ``--hlo``, or ``step_hlo.txt`` in the
trace directory): each event is matched to its HLO instruction, whose metadata gives the JAX name stack and the
Python call stack that emitted it (``benchmarks/hlo_index.py``). A second table sums the device time per scope
prefix (call stack, then named scopes) as a tree, so the share of the loss head, the MLPs, each mixer type or the
optimizer update is read off directly. Without the HLO text the scope is whatever the event's args carry
(``tf_op`` / ``long_name`` / ``hlo_op``). The arg keys seen on the device events are listed, and the first events'
args are kept (``arg_sample``) to show the trace's format. ``python -m benchmarks train --profile DIR`` writes
such a trace of a few training steps and the step's HLO text, and prints this summary.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

from benchmarks import op_families
from benchmarks.hlo_index import HloIndex

SCOPE_KEYS = ("tf_op", "long_name", "hlo_op")
HLO_FILE = "step_hlo.txt"
OUR_KERNELS = ("wy_fwd", "state_fwd", "output_fwd", "state_bwd", "grad_bwd", "grad_wy_bwd", "flash_attention")
CATEGORIES = (  # (category, substrings of a lower-cased event name); the first match wins
    ("pallas recurrent", OUR_KERNELS[:6]),
    ("pallas attention", ("flash_attention",)),
    ("cudnn", ("cudnn",)),
    ("matmul", ("gemm", "cublas", "cutlass", "dot", "matmul", "sm90_xmma", "nvjet")),
    ("collective", ("all-reduce", "all_reduce", "allreduce", "all-gather", "reduce-scatter", "nccl", "rccl")),
)
# the args that mark a memset or a memory copy (the device trace's own kinds of event, not kernels)
TRANSFER_ARGS = {"Memset_details", "memcpy_details"}
# the family of an event matched to no HLO instruction of the step, by its category
CATEGORY_FAMILY = {"pallas recurrent": "recurrent kernels", "pallas attention": "attention",
                   "collective": "collectives"}
SAMPLE_EVENTS = 30
FAMILY_TOP = 5  # the ops kept per op family (``families[i]["top_ops"]``)


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


def scope_tree(paths: dict[tuple[str, ...], float], busy: float, min_share: float = 0.01,
               max_depth: int = 8) -> list[dict]:
    """Device time per scope prefix, as rows of a tree in depth-first order (children by time):
    ``{"scope", "depth", "ms", "share"}``. Prefixes under ``min_share`` of ``busy`` are left out, and a prefix
    whose time is all in one child is shown joined with it (``a > b``)."""
    total: dict[tuple[str, ...], float] = collections.defaultdict(float)
    children: dict[tuple[str, ...], set] = collections.defaultdict(set)
    for path, ms in paths.items():
        for i in range(1, len(path) + 1):
            total[path[:i]] += ms
            children[path[:i - 1]].add(path[:i])
    rows: list[dict] = []

    def visit(prefix: tuple[str, ...], depth: int) -> None:
        for child in sorted(children[prefix], key=lambda c: -total[c]):
            if total[child] < min_share * busy:
                continue
            node = child
            while len(children[node]) == 1 and (only := next(iter(children[node]))) and total[only] == total[node]:
                node = only
            label = " > ".join(node[len(prefix):])
            rows.append(dict(scope=label, depth=depth, ms=total[node], share=total[node] / busy if busy else 0.0))
            if depth + 1 < max_depth:
                visit(node, depth + 1)

    visit((), 0)
    return rows


def self_ms(events: list[dict]) -> list[float]:
    """Each event's own time in ms: its duration less that of the events nested in it on the same line (a CPU
    ``while`` op encloses its body's ops), so time is counted once, at the innermost op. Host traces only."""
    out = [float(e.get("dur", 0.0)) / 1e3 for e in events]
    lines: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(events):
        lines[(e.get("pid"), e.get("tid"))].append(i)
    for idx in lines.values():
        enclosing: list[int] = []  # enclosing events, innermost last
        for i in sorted(idx, key=lambda i: (events[i].get("ts", 0.0), -events[i].get("dur", 0.0))):
            ts = events[i].get("ts", 0.0)
            while enclosing and events[enclosing[-1]].get("ts", 0.0) + events[enclosing[-1]].get("dur", 0.0) <= ts:
                enclosing.pop()
            if enclosing:
                out[enclosing[-1]] -= float(events[i].get("dur", 0.0)) / 1e3
            enclosing.append(i)
    return out


def summarize(trace: str | Path, top: int = 30, hlo: str | Path | None = None, steps: int = 1) -> dict:
    """``{"busy_ms", "source", "ops": [{name, ms, share, count, scope, family}], "categories": {cat: ms}, "scopes":
    [tree rows], "families": [rows], "steps", "outside_matmuls_ms", "hlo", "arg_keys": {key: events}, "arg_sample":
    [{name, dur, args}]}`` of a trace. ``hlo``: the step's HLO text file (default: ``step_hlo.txt`` next to the
    trace, if any); without it ``scopes`` is empty and ``families`` None. ``families``:
    :func:`benchmarks.op_families.family_table` per step of the ``steps`` the trace holds, each row with
    ``top_ops``: its :data:`FAMILY_TOP` biggest ops ``{name, ms, count, scope}`` per step; ``outside_matmuls_ms``:
    :func:`benchmarks.op_families.outside_matmuls` of it (None without)."""
    path = find_trace(trace)
    if hlo is None:
        near = [Path(trace) / HLO_FILE] if Path(trace).is_dir() else []
        hlo = next((p for p in near + [p / HLO_FILE for p in path.parents] if p.is_file()), None)
    index = HloIndex(Path(hlo).read_text()) if hlo else None
    data = json.load(gzip.open(path))
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
    op: dict[str, str] = {}  # what the category reads besides the name: the HLO op or the args' scope
    by_path: dict[tuple[str, ...], float] = collections.defaultdict(float)
    family: dict[str, str] = {}  # event name -> family (of its first event)
    family_rows: list[tuple[str, float, float]] = []  # (family, ms, flops) per event
    family_ops: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0.0, 0])  # (family, name): [ms, n]
    resolved: dict[tuple[str, ...], tuple] = {}  # instructions -> (their scope, family, FLOPs)
    arg_keys: collections.Counter = collections.Counter()
    sample = []
    kept = [e for e in events if e.get("ph") == "X" and keep(e)]
    # Host threads: a ``while`` op encloses its body's ops, so count own time. Device lines: kernel events do not
    # nest, and on a GPU (CUDA graphs) events of one line can overlap, which own time would undercount.
    times = self_ms(kept) if not device else [float(e.get("dur", 0.0)) / 1e3 for e in kept]
    for e, ms in zip(kept, times, strict=True):
        name = e.get("name", "?")
        total[name] += ms
        count[name] += 1
        args = e.get("args") or {}
        arg_keys.update(args.keys())
        if len(sample) < SAMPLE_EVENTS:
            sample.append(dict(name=name, dur=e.get("dur"), args={k: str(v)[:300] for k, v in args.items()}))
        names = tuple(index.resolve(name, args)) if index else ()
        if names and names not in resolved:  # the same instructions run once per step and layer: classify once
            resolved[names] = (index.scope_of(list(names)), *_family(index, list(names)))
        found = resolved[names][0] if names else None
        if index:
            by_path[(found.path or ("(no JAX scope)",)) if found else ("(no HLO instruction)",)] += ms
            fam, flops, moved = (resolved[names][1:] if names else
                                 (CATEGORY_FAMILY.get(category(name), "other"), 0.0, 0.0))
            # a gemm's memset or copy runs under its instruction too: its time is the family's, its FLOPs and
            # bytes are not
            transfer = bool(TRANSFER_ARGS & args.keys())
            family_rows.append((fam, ms, 0.0 if transfer else flops, 0.0 if transfer else moved))
            family_ops[fam, name][0] += ms
            family_ops[fam, name][1] += 1
            family.setdefault(name, fam)
        if found and name not in scope:
            scope[name], op[name] = found.label(), found.op
        for key in SCOPE_KEYS:
            if key in args and name not in scope and not index:
                scope[name] = op[name] = str(args[key])[:160]
    busy = sum(total.values())
    cats: dict[str, float] = collections.defaultdict(float)
    for name, ms in total.items():
        cats[category(f"{name} {op.get(name, '')}")] += ms
    ops = [dict(name=n, ms=ms, share=ms / busy if busy else 0.0, count=count[n], scope=scope.get(n, ""),
                family=family.get(n, "")) for n, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]]
    families = op_families.family_table(family_rows, steps) if index else None
    for row in families or []:  # each family's biggest ops, per step
        mine = sorted(((n, t) for (f, n), t in family_ops.items() if f == row["name"]), key=lambda x: -x[1][0])
        row["top_ops"] = [dict(name=n, ms=ms / steps, count=c / steps, scope=scope.get(n, ""))
                          for n, (ms, c) in mine[:FAMILY_TOP]]
    return dict(busy_ms=busy, source=source, ops=ops, categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                scopes=scope_tree(by_path, busy), families=families, steps=steps,
                outside_matmuls_ms=op_families.outside_matmuls(families) if families else None,
                hlo=str(hlo) if hlo else None, arg_keys=dict(arg_keys.most_common()), arg_sample=sample)


def _family(index: HloIndex, names: list[str]) -> tuple[str, float, float]:
    """The family, FLOPs and bytes of an event that ran one of the instructions ``names`` (several share its kernel
    name: their most common family, their mean FLOPs and bytes)."""
    families = [op_families.classify(index.scopes[n], index.instructions[n]) for n in names]
    mean = lambda key: sum(getattr(index.instructions[n], key) for n in names) / len(names)  # noqa: E731
    return max(families, key=families.count), mean("flops"), mean("bytes")


def format_summary(s: dict, families_only: bool = False) -> str:
    """The summary as text: busy time, categories, op families, the scope tree and the top ops (``families_only``:
    the op family table alone)."""
    families = op_families.format_families(s["families"], s["steps"]) if s.get("families") else []
    if families_only:
        return "\n".join(families or ["no op families: they need the step's HLO text (--hlo)"])
    lines = [f"device busy time {s['busy_ms']:.1f} ms ({s['source']}); scopes from {s['hlo'] or 'event args'}",
             "arg keys seen on these events: " + ", ".join(f"{k} x{n}" for k, n in s["arg_keys"].items()),
             "by category:"]
    lines += [f"  {cat:<30} {ms:9.2f} ms {100 * ms / max(s['busy_ms'], 1e-9):5.1f}%" for cat, ms in
              s["categories"].items()]
    lines += families
    if s["scopes"]:
        lines.append("by scope (call stack > named scopes; prefixes over 1%):")
        lines += [f"  {r['ms']:9.2f} ms {100 * r['share']:5.1f}%  {'  ' * r['depth']}{r['scope'][:100]}"
                  for r in s["scopes"]]
    lines.append(f"top {len(s['ops'])} ops:")
    lines += [f"  {o['ms']:9.2f} ms {100 * o['share']:5.1f}% x{o['count']:<5} {o['name'][:50]:<50} "
              f"{o.get('family', ''):<18} {o['scope'][-110:]}" for o in s["ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks trace_summary", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a trace directory (jax.profiler.trace's log dir) or perfetto_trace.json.gz")
    ap.add_argument("--hlo", help=f"the step's optimized HLO text (default: {HLO_FILE} next to the trace)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--args-sample", help="write the first device events' names and args to this JSON file")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (the op families are per step)")
    ap.add_argument("--families", action="store_true", help="print only the op family table "
                    "(benchmarks/op_families.py)")
    args = ap.parse_args(argv)
    s = summarize(args.trace, args.top, args.hlo, args.steps)
    print(format_summary(s, families_only=args.families))
    if args.args_sample:
        Path(args.args_sample).write_text(json.dumps(s["arg_sample"], indent=1))


if __name__ == "__main__":
    main()
