"""The step's optimized HLO text (``compiled.as_text()``) as an index: each instruction's JAX scope, found by the
names a profiler trace gives its events.

Each instruction's ``metadata`` gives the JAX name stack (``op_name``: named scopes and the primitive, the ``jit`` /
``jvp`` / ``transpose`` wrappers dropped, ``bwd`` when transposed) and the Python call stack (``stack_frame_id`` or
``source_file``: the functions and modules that emitted the op): a :class:`Scope`. An event is matched to its
instruction by an arg that names it (``hlo_op`` and the like), by the event name, or by the kernel name XLA derives
from the instruction name or a Pallas call's name. Each instruction's :class:`Instruction` says what it runs: its
opcode, fusion kind and fused opcodes, custom-call target, the FLOPs of the matmuls in it (read from the shapes:
a ``dot``, a cuBLAS / hipBLAS gemm, cuDNN fused attention, or those fused in it) and its bytes; one instruction's
text is read by :mod:`benchmarks.hlo_text`. Used by ``benchmarks/trace_summary.py``, ``benchmarks/op_families.py``
and ``benchmarks/plan_memory.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re

from benchmarks.hlo_text import array_bytes, array_dims, matmul_flops, operand_bytes, operand_dims, parts

HLO_KEYS = ("hlo_op", "long_name", "name", "kernel_name", "tf_op")  # args naming the HLO op, tried first
# op_name components that are tracing machinery, not scopes (a ``jvp(...)`` / ``transpose(...)`` wrapper keeps
# what it wraps; ``jit(...)`` below the top names a jnp helper and joins the op's label instead)
NOISE = {"while", "body", "cond", "eval_jaxpr", "checkpoint", "remat", "rematted_computation", "scan", "pjit",
         "shard_map", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
WRAPPER = re.compile(r"^(jvp|transpose|vmap|remat|checkpoint|pjit|shard_map|custom_jvp|custom_vjp)\((.*)\)$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


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


@dataclasses.dataclass(frozen=True)
class Instruction:
    """What an HLO instruction runs: its ``opcode``; for a fusion its ``kind`` (``kLoop``, ``kInput``, ``kOutput``,
    ``kCustom``) and ``fused``, the opcodes of the computation it calls (nested fusions included); for a custom call
    its ``target`` (``__cublas$lt$matmul``, ``__cudnn$fmhaSoftmax``, ``__gpu$xla.gpu.triton``, ...); ``flops``: the
    FLOPs of the matmuls it runs (:func:`~benchmarks.hlo_text.matmul_flops`; a fusion's are those of the dots it
    fuses), 0 for none; ``bytes``: the sizes of its result and of each operand, what a memory-bound kernel moves if it
    reads each operand once (an upper bound where it reads only a slice of one, as a gather does of its table)."""

    opcode: str
    kind: str = ""
    target: str = ""
    fused: frozenset[str] = frozenset()
    flops: float = 0.0
    bytes: int = 0


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
    """The instructions of an optimized HLO module text (``compiled.as_text()``), found by name or kernel name;
    ``computations`` (each one's instructions), ``in_loops`` (those a while loop's body reaches) and ``runs`` (the
    computations the step executes as kernels of their own, not fused or applied ones: how many times each runs, a
    loop body its loop's known trip count times).

    ``scopes[instruction]``: its :class:`Scope`. The Python frames all instructions share (the driver script, the
    jitted function's caller) are dropped from the paths, so a path starts inside the jitted function. The
    computations that reduce, sort or scatter apply (``to_apply=``) are left out of that count: their stacks can be
    shorter (a CPU step's sort comparators start inside the step), and they run inside the op that applies them.
    """

    def __init__(self, text: str):
        m = re.search(r"^HloModule\s+([\w.\-]+)", text, re.M)
        self.module = m.group(1) if m else ""
        frames = self._stack_frames(text)
        raw: dict[str, tuple[list[str], list[str], str, str]] = {}  # name -> (functions, scopes, op, source)
        fused: dict[str, list[str]] = collections.defaultdict(list)  # computation -> its instructions
        calls: dict[str, str] = {}  # fusion -> its computation
        callees: dict[str, set[str]] = collections.defaultdict(set)  # computation -> those its instructions run
        bodies: set[str] = set()  # while loops' bodies
        applied: set[str] = set()  # computations a reduce / sort / scatter applies
        aliases: dict[str, set[str]] = collections.defaultdict(set)  # kernel name -> instructions
        shapes: dict[str, list[tuple[int, ...]]] = {}  # name -> the dims of its result (each of a tuple's arrays)
        sizes: dict[str, list[int]] = {}  # name -> the bytes of each array of its result
        operand_names: dict[str, list[tuple[str, str]]] = {}  # name -> its operands (name, tuple index or "")
        runs_in: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)  # callee -> (caller, times)
        entry = ""
        own: dict[str, Instruction] = {}  # name -> what it runs, without the computation it calls
        computation = ""
        for line in text.splitlines():
            if line[:1].strip() and line.rstrip().endswith("{"):  # a computation's header
                computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
                entry = computation if line.startswith("ENTRY") else entry
                continue
            if not (m := INSTRUCTION.match(line)):
                continue
            name, rest = m.groups()
            fused[computation].append(name)
            meta = rest[rest.find("metadata={"):] if "metadata={" in rest else ""
            op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
            shape, opcode, operands, attrs = parts(rest)
            scopes, op = parse_op_name(op_name.group(1)) if op_name else ([], opcode)
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
            shapes[name] = array_dims(shape)
            sizes[name] = array_bytes(shape)
            operand_names[name] = re.findall(r"%([\w.\-]+)(?:#(\d+))?", operands)
            if opcode in ("while", "conditional", "call"):  # computations whose ops run as kernels of their own
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs) if opcode == "while" else None
                for callee in re.findall(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)"
                                         r"=%([\w.\-]+)", attrs):
                    runs_in[callee].append((computation, int(trip.group(1)) if trip else 1))
                for callee in re.findall(r"%([\w.\-]+)", attrs.partition("branch_computations={")[2].partition("}")[0]):
                    runs_in[callee].append((computation, 1))
            target = re.search(r'custom_call_target="([^"]+)"', attrs)
            kind = re.search(r"\bkind=(k\w+)", attrs)
            own[name] = Instruction(opcode, kind.group(1) if kind else "", target.group(1) if target else "",
                                    flops=matmul_flops(opcode, attrs, shapes[name], operand_dims(operands, shapes)),
                                    bytes=sum(sizes[name]) + sum(operand_bytes(sizes.get(o, []), k)
                                                                 for o, k in operand_names[name]))
            aliases[re.sub(r"\W", "_", name)].add(name)
            if c := re.search(r"\bcalls=%([\w.\-]+)", rest):
                calls[name] = c.group(1)
            applied.update(re.findall(r"\bto_apply=%([\w.\-]+)", rest))
            callees[computation].update(re.findall(r"\b(?:calls|body|condition|to_apply)=%([\w.\-]+)", rest))
            bodies.update(re.findall(r"\bbody=%([\w.\-]+)", rest))
            if "custom_call_target" in rest and (k := re.search(r'"(?:kernel_)?name"\s*:\s*"([^"\\]+)"', rest)):
                aliases[k.group(1)].add(name)  # a Pallas / Triton kernel's own name
        for name, comp in calls.items():  # a fusion without a scope of its own takes its deepest fused op's
            if not raw[name][0] and not raw[name][1]:
                inner = [raw[i] for i in fused.get(comp, ()) if i in raw]
                if inner:
                    best = max(inner, key=lambda r: len(r[0]) + len(r[1]))
                    raw[name] = (best[0], best[1], raw[name][2], best[3])
        appliers = {i for comp in applied for i in fused.get(comp, ())}
        common = _common_prefix([tuple(r[0]) for name, r in raw.items() if r[0] and name not in appliers])
        self.scopes = {}
        for name, (functions, scopes, op, source) in raw.items():
            kept = functions[common:] or functions[max(common - 1, 0):common]
            self.scopes[name] = Scope(tuple(kept + scopes), op, source)
        self.aliases = {k: sorted(v) for k, v in aliases.items()}
        self.instructions = self._with_fused(own, fused, calls)
        self.computations = dict(fused)  # computation -> its instructions, in order
        self.in_loops = self._reached(bodies, callees)
        self.runs = self._runs(entry, runs_in)

    @staticmethod
    def _reached(bodies: set[str], callees: dict[str, set[str]]) -> frozenset[str]:
        """The computations a while loop's body reaches (run once per iteration): the bodies and every computation
        they call, apply or loop over, nested."""
        reached, todo = set(), list(bodies)
        while todo:
            if (name := todo.pop()) not in reached:
                reached.add(name)
                todo.extend(callees.get(name, ()))
        return frozenset(reached)

    @staticmethod
    def _runs(entry: str, runs_in: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
        """Per computation executed on its own (the entry and what its ``while``, ``conditional`` and ``call``
        instructions run, nested): its runs per step, each caller's runs times the trip count (1
        where unknown; every branch of a conditional counted as run)."""
        memo: dict[str, int] = {entry: 1} if entry else {}

        def runs(comp: str, seen: frozenset[str] = frozenset()) -> int:
            if comp not in memo:
                memo[comp] = sum(runs(caller, seen | {comp}) * times for caller, times in runs_in.get(comp, ())
                                 if caller not in seen)
            return memo[comp]

        return {comp: n for comp in [entry, *runs_in] if comp and (n := runs(comp))}

    @staticmethod
    def _with_fused(own: dict[str, Instruction], computations: dict[str, list[str]], calls: dict[str, str]
                    ) -> dict[str, Instruction]:
        """``own`` with each caller's ``fused`` opcodes (nested calls included) and, for a fusion, its fused dots'
        FLOPs: a fusion event runs them all. A ``while`` names its body with ``body=``, not ``calls=``: its body's
        ops are events of their own."""
        memo: dict[str, tuple[frozenset[str], float]] = {}

        def contents(comp: str) -> tuple[frozenset[str], float]:
            if comp not in memo:
                memo[comp] = (frozenset(), 0.0)  # a cycle (none in valid HLO) ends here
                ops, flops = set(), 0.0
                for name in computations.get(comp, ()):
                    ops.add(own[name].opcode)
                    flops += own[name].flops
                    if name in calls:
                        inner_ops, inner_flops = contents(calls[name])
                        ops |= inner_ops
                        flops += inner_flops if own[name].opcode == "fusion" else 0.0
                memo[comp] = (frozenset(ops), flops)
            return memo[comp]

        out = dict(own)
        for name, comp in calls.items():
            ops, flops = contents(comp)
            extra = flops if own[name].opcode == "fusion" else 0.0
            out[name] = dataclasses.replace(own[name], fused=ops, flops=own[name].flops + extra)
        return out

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

    def resolve(self, name: str, args: dict) -> list[str]:
        """The instructions a trace event runs: the one named by an arg (``hlo_op`` and the like first), by the event
        name, or by a kernel name XLA derived from an instruction (``fusion.3`` -> ``fusion_3``, a Pallas call's
        name), several when instructions share a kernel name; of the values that name some, the first whose
        (common) scope is deepest. Empty for another module's ops and for names of none."""
        module = str(args.get("hlo_module", ""))
        if module and self.module and re.match(r"[\w.\-]*", module).group(0) != self.module:
            return []
        values = [args[k] for k in HLO_KEYS if k in args] + [name]
        values += [v for k, v in args.items() if k not in HLO_KEYS]
        best: list[str] = []
        depth = -1
        for value in values:
            if isinstance(value, str) and (names := self._names(value)):
                if (d := len(self.scope_of(names).path)) > depth:
                    best, depth = names, d
        return best

    def find(self, name: str, args: dict) -> Scope | None:
        """The scope of a trace event (:meth:`resolve`); instructions sharing a kernel name give their common path.
        None for another module's ops."""
        names = self.resolve(name, args)
        return self.scope_of(names) if names else None

    def _names(self, value: str) -> list[str]:
        """The instructions ``value`` names, as an instruction or a kernel (``%fusion.3 = ...`` counts as
        ``fusion.3``)."""
        if not (m := re.match(r"\s*%?([\w.\-]+)", value)):
            return []
        token = m.group(1)
        if token in self.scopes:
            return [token]
        return self.aliases.get(token) or self.aliases.get(re.sub(r"\W", "_", token)) or []

    def scope_of(self, names: list[str]) -> Scope:
        """The scope of one instruction, or the common one of several (``various`` ops, no source if they differ)."""
        if len(names) == 1:
            return self.scopes[names[0]]
        scopes = [self.scopes[i] for i in names]
        n = _common_prefix([s.path for s in scopes])
        ops = {s.op for s in scopes}
        return Scope(scopes[0].path[:n], ops.pop() if len(ops) == 1 else "various", "")
