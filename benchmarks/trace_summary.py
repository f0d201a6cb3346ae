"""Where a jitted step's device time goes: a summary of a ``jax.profiler`` trace (perfetto JSON).

    python -m benchmarks trace_summary TRACE_DIR_OR_FILE [--hlo step_hlo.txt] [--top 30] [--args-sample FILE]

Reads ``perfetto_trace.json.gz`` (written by ``jax.profiler.trace(dir, create_perfetto_trace=True)``; found under
``TRACE_DIR`` when a directory is given), keeps the complete events of the device processes (``/device:...``;
on a CPU-only trace, the XLA executor threads of the host), and adds up their durations per event name: one row
per kernel or HLO op, with its share of the device's busy time, the call count and its scope. Also a split by
category: our Pallas recurrent and attention kernels (by the names we give them), cuDNN, matmuls (GEMM / cuBLAS /
``dot``), collectives, and the rest (XLA fusions).

The scope comes from the step's optimized HLO text (``compiled.as_text()``; ``--hlo``, or ``step_hlo.txt`` in the
trace directory): each event is matched to its HLO instruction (by an arg that names it, such as ``hlo_op``, by
the event name, or by the kernel name XLA derives from the instruction name or a Pallas call's name), whose
``metadata`` gives the JAX name stack (``op_name``: named scopes and the primitive, the ``jit`` / ``jvp`` /
``transpose`` wrappers dropped, ``bwd`` when transposed) and the Python call stack (``stack_frame_id`` or
``source_file``: the functions and modules that emitted the op). A second table sums the device time per scope
prefix (call stack, then named scopes) as a tree, so the share of the loss head, the MLPs, each mixer type or the
optimizer update is read off directly. Without the HLO text the scope is whatever the event's args carry
(``tf_op`` / ``long_name`` / ``hlo_op``). The arg keys seen on the device events are listed, and the first events'
args are kept (``arg_sample``) to show the trace's format. ``python -m benchmarks train --profile DIR`` writes
such a trace of a few training steps and the step's HLO text, and prints this summary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
from pathlib import Path

SCOPE_KEYS = ("tf_op", "long_name", "hlo_op")
HLO_KEYS = ("hlo_op", "long_name", "name", "kernel_name", "tf_op")  # args naming the HLO op, tried first
HLO_FILE = "step_hlo.txt"
OUR_KERNELS = ("wy_fwd", "state_fwd", "output_fwd", "state_bwd", "grad_bwd", "grad_wy_bwd", "flash_attention")
CATEGORIES = (  # (category, substrings of a lower-cased event name); the first match wins
    ("pallas recurrent", OUR_KERNELS[:6]),
    ("pallas attention", ("flash_attention",)),
    ("cudnn", ("cudnn",)),
    ("matmul", ("gemm", "cublas", "cutlass", "dot", "matmul", "sm90_xmma", "nvjet")),
    ("collective", ("all-reduce", "all_reduce", "allreduce", "all-gather", "reduce-scatter", "nccl", "rccl")),
)
# op_name components that are tracing machinery, not scopes (a ``jvp(...)`` / ``transpose(...)`` wrapper keeps
# what it wraps; ``jit(...)`` below the top names a jnp helper and joins the op's label instead)
NOISE = {"while", "body", "cond", "eval_jaxpr", "checkpoint", "remat", "rematted_computation", "scan", "pjit",
         "shard_map", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
WRAPPER = re.compile(r"^(jvp|transpose|vmap|remat|checkpoint|pjit|shard_map|custom_jvp|custom_vjp)\((.*)\)$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
SAMPLE_EVENTS = 30


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where an HLO instruction comes from: ``path`` (call stack functions, then named scopes, outermost first),
    ``op`` (the primitive, with ``bwd`` when it is in a transpose and any ``jit``-wrapped jnp helper) and
    ``source`` (``file.py:line`` of the innermost frame)."""

    path: tuple[str, ...]
    op: str
    source: str

    def label(self) -> str:
        """``a > b > c | op @file.py:line``: the scope column of the per-op table."""
        where = f" @{self.source}" if self.source else ""
        return f"{' > '.join(self.path)} | {self.op}{where}"


def _unwrap(component: str) -> str:
    """``transpose(jvp(HybridLM))`` -> ``HybridLM``; ``jvp()`` -> ``""``."""
    while m := WRAPPER.match(component):
        component = m.group(2)
    return component


def parse_op_name(op_name: str) -> tuple[list[str], str]:
    """A JAX name stack (``jit(step)/while/body/transpose(jvp(mlp))/jit(silu)/mul``) -> its named scopes
    (``["mlp"]``) and op label (``"bwd silu.mul"``). Metadata XLA merged (``a;b``) keeps its first part."""
    op_name = op_name.split(";")[0]
    parts = op_name.split("/")
    if len(parts) == 1:  # an XLA-made name ("broadcast.92") or a parameter's name: no scope
        return [], op_name
    scopes, helpers = [], []
    for i, part in enumerate(parts[:-1]):
        inner = _unwrap(part)
        if i == 0 and inner.startswith("jit("):  # the jitted function itself
            continue
        if inner.startswith("jit(") and inner.endswith(")"):
            helpers.append(_unwrap(inner[4:-1]))
        elif inner and inner not in NOISE:
            scopes.append(inner)
    op = ".".join(dict.fromkeys([h for h in helpers if h] + [_unwrap(parts[-1])]))  # jit(sort)/sort: "sort"
    return scopes, f"bwd {op}" if "transpose(" in op_name else op


def _function_label(name: str) -> str:
    """``make_train_step.<locals>.step.<locals>.accumulate`` -> ``step.accumulate``; ``MLP.__call__`` -> ``MLP``."""
    parts = [p for p in name.split(".") if p != "<locals>"]
    if len(parts) > 1 and parts[-1] == "__call__":
        parts.pop()
    return ".".join(parts[-2:])


def _common_prefix(paths: list[tuple[str, ...]]) -> int:
    """Length of the longest prefix all ``paths`` share."""
    if not paths:
        return 0
    n = min(len(p) for p in paths)
    for i in range(n):
        if any(p[i] != paths[0][i] for p in paths):
            return i
    return n


class HloIndex:
    """The instructions of an optimized HLO module text (``compiled.as_text()``), found by name or kernel name.

    ``scopes[instruction]``: its :class:`Scope`. The Python frames all instructions share (the driver script, the
    jitted function's caller) are dropped from the paths, so a path starts inside the jitted function.
    """

    def __init__(self, text: str):
        m = re.search(r"^HloModule\s+([\w.\-]+)", text, re.M)
        self.module = m.group(1) if m else ""
        frames = self._stack_frames(text)
        raw: dict[str, tuple[list[str], list[str], str, str]] = {}  # name -> (functions, scopes, op, source)
        fused: dict[str, list[str]] = collections.defaultdict(list)  # computation -> its instructions
        calls: dict[str, str] = {}  # fusion -> its computation
        aliases: dict[str, set[str]] = collections.defaultdict(set)  # kernel name -> instructions
        computation = ""
        for line in text.splitlines():
            if line[:1].strip() and line.rstrip().endswith("{"):  # a computation's header
                computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
                continue
            if not (m := INSTRUCTION.match(line)):
                continue
            name, rest = m.groups()
            fused[computation].append(name)
            meta = rest[rest.find("metadata={"):] if "metadata={" in rest else ""
            op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
            scopes, op = parse_op_name(op_name.group(1)) if op_name else ([], _opcode(rest))
            stack: list[tuple[str, str, int]] = []
            if sid := re.search(r"stack_frame_id=(\d+)", meta):
                stack = frames.get(int(sid.group(1)), [])
            elif src := re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', meta):
                stack = [(src.group(1), "", int(src.group(2)))]
            chain: list[tuple[str, str, int]] = []
            for frame in stack:  # a scan body's stack repeats its caller's: cut such loops
                chain = chain[:chain.index(frame)] if frame in chain else chain
                chain.append(frame)
            functions = [_function_label(f) if f else f"{os.path.basename(file)}:{ln}" for file, f, ln in chain
                         if f != "<module>"]
            functions = [f for i, f in enumerate(functions) if i == 0 or f != functions[i - 1]]
            source = f"{os.path.basename(stack[-1][0])}:{stack[-1][2]}" if stack else ""
            raw[name] = (functions, scopes, op, source)
            aliases[re.sub(r"\W", "_", name)].add(name)
            if c := re.search(r"\bcalls=%([\w.\-]+)", rest):
                calls[name] = c.group(1)
            if "custom_call_target" in rest and (k := re.search(r'"(?:kernel_)?name"\s*:\s*"([^"\\]+)"', rest)):
                aliases[k.group(1)].add(name)  # a Pallas / Triton kernel's own name
        for name, comp in calls.items():  # a fusion without a scope of its own takes its deepest fused op's
            if not raw[name][0] and not raw[name][1]:
                inner = [raw[i] for i in fused.get(comp, ()) if i in raw]
                if inner:
                    best = max(inner, key=lambda r: len(r[0]) + len(r[1]))
                    raw[name] = (best[0], best[1], raw[name][2], best[3])
        common = _common_prefix([tuple(r[0]) for r in raw.values() if r[0]])
        self.scopes = {}
        for name, (functions, scopes, op, source) in raw.items():
            kept = functions[common:] or functions[max(common - 1, 0):common]
            self.scopes[name] = Scope(tuple(kept + scopes), op, source)
        self.aliases = {k: sorted(v) for k, v in aliases.items()}

    @staticmethod
    def _stack_frames(text: str) -> dict[int, list[tuple[str, str, int]]]:
        """The module's stack frame table: frame id -> ``[(file, function, line)]``, outermost call first."""
        tables: dict[str, dict[int, str]] = {s: {} for s in SECTIONS}
        section = None
        for line in text.splitlines():
            if line.strip() in SECTIONS:
                section = line.strip()
            elif not line.strip() or not line[0].isdigit():
                section = None
            elif section:
                key, _, value = line.partition(" ")
                tables[section][int(key)] = value.strip()
        fields = lambda v: {k: int(x) for k, x in re.findall(r"(\w+)=(\d+)", v)}
        names = {k: v.strip('"') for k, v in tables["FileNames"].items()}
        functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
        locations = {k: fields(v) for k, v in tables["FileLocations"].items()}
        parents = {k: fields(v) for k, v in tables["StackFrames"].items()}
        # the text prints a frame's parent as its id + 1 (the root frame is its own "parent"); 0 would be none
        shift = 1 if any(f.get("parent_frame_id") == k for k, f in parents.items()) else 0
        out = {}
        for fid in parents:
            stack, seen, cur = [], set(), fid
            while cur in parents and cur not in seen:
                seen.add(cur)
                loc = locations.get(parents[cur].get("file_location_id", 0), {})
                stack.append((names.get(loc.get("file_name_id"), "?"), functions.get(loc.get("function_name_id"), ""),
                              loc.get("line", 0)))
                cur = parents[cur].get("parent_frame_id", 0) - shift
            out[fid] = stack[::-1]
        return out

    def find(self, name: str, args: dict) -> Scope | None:
        """The scope of a trace event: its instruction named by an arg (``hlo_op`` and the like first), by the event
        name, or by a kernel name XLA derived from an instruction (``fusion.3`` -> ``fusion_3``, a Pallas call's
        name). A kernel name several instructions share gets their common path. None for another module's ops."""
        module = str(args.get("hlo_module", ""))
        if module and self.module and re.match(r"[\w.\-]*", module).group(0) != self.module:
            return None
        values = [args[k] for k in HLO_KEYS if k in args] + [name]
        values += [v for k, v in args.items() if k not in HLO_KEYS]
        found = [s for v in values if isinstance(v, str) and (s := self._match(v))]
        return max(found, key=lambda s: len(s.path)) if found else None  # the first of the deepest

    def _match(self, value: str) -> Scope | None:
        """The scope of the instruction or kernel ``value`` names (``%fusion.3 = ...`` counts as ``fusion.3``)."""
        if not (m := re.match(r"\s*%?([\w.\-]+)", value)):
            return None
        token = m.group(1)
        if token in self.scopes:
            return self.scopes[token]
        found = self.aliases.get(token) or self.aliases.get(re.sub(r"\W", "_", token))
        if not found:
            return None
        scopes = [self.scopes[i] for i in found]
        n = _common_prefix([s.path for s in scopes])
        ops = {s.op for s in scopes}
        return Scope(scopes[0].path[:n], ops.pop() if len(ops) == 1 else "various",
                     scopes[0].source if len(scopes) == 1 else "")


def _opcode(rest: str) -> str:
    """The opcode of an instruction's right-hand side (``f32[2]{0} fusion(%a), ...`` -> ``fusion``)."""
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[-1]
    m = re.match(r"\s*([\w\-]+)\(", rest)
    return m.group(1) if m else "?"


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


def summarize(trace: str | Path, top: int = 30, hlo: str | Path | None = None) -> dict:
    """``{"busy_ms", "source", "ops": [{name, ms, share, count, scope}], "categories": {cat: ms}, "scopes": [tree
    rows], "hlo", "arg_keys": {key: events}, "arg_sample": [{name, dur, args}]}`` of a trace. ``hlo``: the step's HLO
    text file (default: ``step_hlo.txt`` next to the trace, if any); without it ``scopes`` is empty."""
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
        found = index.find(name, args) if index else None
        if index:
            by_path[(found.path or ("(no JAX scope)",)) if found else ("(no HLO instruction)",)] += ms
        if found and name not in scope:
            scope[name], op[name] = found.label(), found.op
        for key in SCOPE_KEYS:
            if key in args and name not in scope and not index:
                scope[name] = op[name] = str(args[key])[:160]
    busy = sum(total.values())
    cats: dict[str, float] = collections.defaultdict(float)
    for name, ms in total.items():
        cats[category(f"{name} {op.get(name, '')}")] += ms
    ops = [dict(name=n, ms=ms, share=ms / busy if busy else 0.0, count=count[n], scope=scope.get(n, ""))
           for n, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]]
    return dict(busy_ms=busy, source=source, ops=ops, categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                scopes=scope_tree(by_path, busy), hlo=str(hlo) if hlo else None, arg_keys=dict(arg_keys.most_common()),
                arg_sample=sample)


def format_summary(s: dict) -> str:
    lines = [f"device busy time {s['busy_ms']:.1f} ms ({s['source']}); scopes from {s['hlo'] or 'event args'}",
             "arg keys seen on these events: " + ", ".join(f"{k} x{n}" for k, n in s["arg_keys"].items()),
             "by category:"]
    lines += [f"  {cat:<30} {ms:9.2f} ms {100 * ms / max(s['busy_ms'], 1e-9):5.1f}%" for cat, ms in
              s["categories"].items()]
    if s["scopes"]:
        lines.append("by scope (call stack > named scopes; prefixes over 1%):")
        lines += [f"  {r['ms']:9.2f} ms {100 * r['share']:5.1f}%  {'  ' * r['depth']}{r['scope'][:100]}"
                  for r in s["scopes"]]
    lines.append(f"top {len(s['ops'])} ops:")
    lines += [f"  {o['ms']:9.2f} ms {100 * o['share']:5.1f}% x{o['count']:<5} {o['name'][:50]:<50} "
              f"{o['scope'][-110:]}" for o in s["ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks trace_summary", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a trace directory (jax.profiler.trace's log dir) or perfetto_trace.json.gz")
    ap.add_argument("--hlo", help=f"the step's optimized HLO text (default: {HLO_FILE} next to the trace)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--args-sample", help="write the first device events' names and args to this JSON file")
    args = ap.parse_args(argv)
    s = summarize(args.trace, args.top, args.hlo)
    print(format_summary(s))
    if args.args_sample:
        Path(args.args_sample).write_text(json.dumps(s["arg_sample"], indent=1))


if __name__ == "__main__":
    main()
