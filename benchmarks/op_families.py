"""A train step's device time by op family: each traced HLO instruction in exactly one family, and for the matmul
families the TFLOP/s their matmuls achieve.

Families (:data:`FAMILIES`; the shares add up to 1): the LM head and loss, the token embedding (its lookup and the
gradient's scatter-add), the MLPs' matmuls and their element-wise ops (SwiGLU), the mixers' projections (GDN, KDA,
Mamba2 and MLA linear layers) and their element-wise ops (short convs, gates, RoPE), the recurrent kernels (all that
runs under ``kernels.chunk_*``: the Pallas launches and their XLA glue), attention (all under ``kernels.attention``:
cuDNN, the Pallas flash kernel or plain XLA), norms, the optimizer (all the step runs outside the loss: gradient
accumulation, clipping, AdamW, the finite check), copies and transposes, collectives, and other.

An instruction is put in its family by what it runs (:class:`~benchmarks.hlo_index.Instruction`) and where it comes
from (its :class:`~benchmarks.hlo_index.Scope`):

1. a collective (all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all; async or fused) is one;
2. a copy, transpose or other pure data movement (a fusion of such ops only) is "copies/transposes";
3. otherwise the innermost element of its scope path (a frame's function or class, or a named scope) that names a
   part of the model or step (:data:`MARKERS`) decides: the MLP and the mixers split into their matmuls (a ``dot``,
   a gemm or cuDNN call, a fusion with a dot) and the rest; an op in the loss function or a ``Sublayer`` but in no
   finer part (the residual adds, also those a remat recomputes) is "other";
4. an op with a scope but no marker is "optimizer" (in a train step all outside the loss is the update); an op
   without a scope (a copy XLA added) is "other".

The TFLOP/s of a matmul family is the FLOPs of its matmuls (``Instruction.flops``: from the HLO shapes) over the
device time of the events that ran them, not over the family's whole time; the TB/s of a family is the bytes that
its other events' instructions read and write (``Instruction.bytes``: each operand counted whole) over their time,
so an element-wise family near the memory's bandwidth has no time left to win but by fusing it away.
"""

from __future__ import annotations

from collections.abc import Iterable

from benchmarks.hlo_index import HloIndex, Instruction, Scope

FAMILIES = ("LM head and loss", "embedding", "MLP matmuls", "MLP element-wise", "mixer projections",
            "mixer element-wise", "recurrent kernels", "attention", "norms", "optimizer", "copies/transposes",
            "collectives", "other")
MATMUL_FAMILIES = ("LM head and loss", "MLP matmuls", "mixer projections", "attention")
# The functions and classes whose frames (or named scopes) mark a part of the model on a scope path, by a dotted
# part of a path element (``GatedDeltaNet._mix``: ``GatedDeltaNet``); a test checks them against the code. A
# custom VJP's backward ops carry the frames of its call, not of its rules: ``HybridLM.features`` names its lookup
# call with a ``lookup`` scope for that.
MARKERS = {
    "cross_entropy": "head", "tied_logits": "head",  # hybrid_jax.train.step.loss, hybrid_jax.model.stack
    "lookup": "embedding",  # hybrid_jax.model.layers (and the named scope around its call)
    "MLP": "mlp",
    "GatedDeltaNet": "mixer", "KimiDeltaAttention": "mixer", "Mamba2": "mixer", "MLA": "mixer",
    "RMSNorm": "norm", "GatedRMSNorm": "norm", "rms_norm": "norm", "add_rms_norm": "norm",  # kernels.rms_norm
    "chunk_gated_delta_rule": "recurrent", "chunk_kda": "recurrent", "chunk_simple_gla": "recurrent",  # kernels
    "attention": "attention",  # kernels.api (MLA, also its context-parallel form)
    "batch_loss": "loss", "context_batch_loss": "loss",  # hybrid_jax.train.step
    # the residual stream (hybrid_jax.model.stack): a rematerialised sublayer's recomputed ops carry the frames from
    # the remat wrapper in, not the loss's, so its residual add would otherwise read as the optimizer's
    "Sublayer": "loss",
}
# a marker's family: (for its matmuls, for the rest)
FAMILY_OF = {
    "head": ("LM head and loss",) * 2, "embedding": ("embedding",) * 2,
    "mlp": ("MLP matmuls", "MLP element-wise"), "mixer": ("mixer projections", "mixer element-wise"),
    "norm": ("norms",) * 2, "recurrent": ("recurrent kernels",) * 2, "attention": ("attention",) * 2,
    "loss": ("other",) * 2,
}
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast", "ragged-all-to-all"}
MOVES = {"copy", "transpose", "concatenate", "slice", "dynamic-slice", "dynamic-update-slice", "pad", "reverse",
         "bitcast", "reshape", "broadcast", "copy-start", "copy-done", "parameter", "constant", "tuple",
         "get-tuple-element", "iota"}
MATMULS = {"dot", "convolution"}
INERT = {"parameter", "constant", "tuple", "get-tuple-element"}  # name values, run nothing


def _base(opcode: str) -> str:
    """``all-reduce-start`` -> ``all-reduce``."""
    return opcode.removesuffix("-start").removesuffix("-done")


def is_collective(ins: Instruction) -> bool:
    """A collective, async or wrapped in a computation (``async-start`` calling an all-gather)."""
    return any(_base(op) in COLLECTIVES for op in {ins.opcode, *ins.fused})


def is_matmul(ins: Instruction) -> bool:
    """A dot or convolution, a gemm or fused-attention library call, or a fusion with a dot in it."""
    library = any(k in ins.target.lower() for k in ("gemm", "matmul", "fmha"))
    return ins.flops > 0 or ins.opcode in MATMULS or bool(ins.fused & MATMULS) or library


def moves_only(ins: Instruction) -> bool:
    """Pure data movement: a copy, transpose, concatenate, slice, pad ... or a fusion of nothing else (a fusion of
    parameters and bitcasts only moves nothing: its scope decides)."""
    if ins.opcode == "fusion":
        return bool(ins.fused - INERT - {"bitcast"}) and ins.fused <= MOVES
    return ins.opcode in MOVES - INERT


def marker(path: tuple[str, ...]) -> str | None:
    """The innermost model part (a :data:`MARKERS` value) on a scope path, None if there is none."""
    for element in reversed(path):
        for part in reversed(element.split(".")):
            if (kind := MARKERS.get(part)) is not None:
                return kind
    return None


def classify(scope: Scope, ins: Instruction) -> str:
    """The family of one instruction, one of :data:`FAMILIES` (the rules are in the module docstring)."""
    if is_collective(ins):
        return "collectives"
    if moves_only(ins):
        return "copies/transposes"
    if (kind := marker(scope.path)) is not None:
        matmul, rest = FAMILY_OF[kind]
        return matmul if is_matmul(ins) else rest
    return "optimizer" if scope.path else "other"


# instructions that launch no kernel of their own (a loop's or call's ops are counted in its computation), beside
# the second halves of async pairs (``*-done``: a pair counts once, by its start)
NO_KERNEL = INERT | {"bitcast", "while", "conditional", "call", "after-all", "partition-id", "replica-id"}


def family_bytes(index: HloIndex) -> dict[str, float]:
    """Per family (:data:`FAMILIES` order), the bytes per step that the compiled step's kernels read and write, by
    ``Instruction.bytes`` (each operand counted whole) times the runs of the computation it is in
    (``HloIndex.runs``): a GPU-free estimate of each family's memory traffic, for a step compiled for a device
    without running it."""
    total = dict.fromkeys(FAMILIES, 0.0)
    for computation, runs in index.runs.items():
        for name in index.computations.get(computation, ()):
            ins = index.instructions[name]
            if ins.opcode not in NO_KERNEL and not ins.opcode.endswith("-done"):
                total[classify(index.scopes[name], ins)] += ins.bytes * runs
    return total


def family_table(rows: Iterable[tuple[str, float, float, float]], steps: int = 1) -> list[dict]:
    """Per family, from ``(family, ms, flops, bytes)`` per traced event: ``{"name", "ms", "share", "flops",
    "matmul_ms", "tflops", "gb", "tbps"}`` with ``ms`` and ``flops`` per step (the trace holds ``steps`` steps),
    ``share`` of the summed time (the shares add up to 1), ``matmul_ms`` the time of the events with counted FLOPs and
    ``tflops`` their FLOPs over that time (None outside :data:`MATMUL_FAMILIES` or without counted FLOPs). ``gb``: the
    bytes per step (GB) of the events outside the family's matmuls (all its events outside
    :data:`MATMUL_FAMILIES`), ``tbps`` those bytes over those events' time (TB/s; None without such time or bytes, as
    for a matmul family whose other events are memsets): how near the memory's bandwidth its memory-bound work runs.
    Every family has a row, in :data:`FAMILIES` order."""
    ms = dict.fromkeys(FAMILIES, 0.0)
    flops, matmul_ms, moved = dict(ms), dict(ms), dict(ms)
    for family, t, f, b in rows:
        ms[family] += t
        flops[family] += f
        matmul_ms[family] += t if f > 0 else 0.0
        moved[family] += b if f == 0 or family not in MATMUL_FAMILIES else 0.0
    total = sum(ms.values())
    table = []
    for name in FAMILIES:
        rest = ms[name] - (matmul_ms[name] if name in MATMUL_FAMILIES else 0.0)
        table.append(dict(
            name=name, ms=ms[name] / steps, share=ms[name] / total if total else 0.0, flops=flops[name] / steps,
            matmul_ms=matmul_ms[name] / steps,
            tflops=flops[name] / matmul_ms[name] / 1e9 if name in MATMUL_FAMILIES and matmul_ms[name] else None,
            gb=moved[name] / steps / 1e9, tbps=moved[name] / rest / 1e9 if rest > 0 and moved[name] else None))
    return table


def outside_matmuls(table: list[dict]) -> float:
    """Of a :func:`family_table`, the ms per step outside the matmul families' matmul events: every other family's
    time and what the LM head's, the MLPs', the mixers' projections' and attention's families run besides matmuls."""
    return sum(r["ms"] - (r["matmul_ms"] if r["name"] in MATMUL_FAMILIES else 0.0) for r in table)


def format_families(table: list[dict], steps: int) -> list[str]:
    """The family table as text lines: ms per step, share, TFLOP/s of the matmul families (with their matmuls'
    time), the TB/s of the rest (with its GB), under each family its three biggest ops (a row's ``top_ops``, where
    the table has them), then the time outside the matmuls (:func:`outside_matmuls`)."""
    lines = [f"by op family (per step, {steps} traced; TFLOP/s: the family's matmul FLOPs over those events' time; "
             "TB/s: the bytes its other events read and write, each operand whole, over their time):"]
    for r in table:
        rate = f"  {r['tflops']:7.4g} TFLOP/s over {r['matmul_ms']:.3f} ms" if r["tflops"] is not None else ""
        if r.get("tbps") is not None:
            rate += f"  {r['tbps']:5.2f} TB/s ({r['gb']:.1f} GB)"
        lines.append(f"  {r['name']:<20} {r['ms']:9.3f} ms {100 * r['share']:5.1f}%{rate}")
        lines += [f"      {o['ms']:9.3f} ms  {o['name'][:60]}" for o in r.get("top_ops", [])[:3]]
    total, rest = sum(r["ms"] for r in table), outside_matmuls(table)
    lines.append(f"  outside the matmuls  {rest:9.3f} ms {100 * rest / total if total else 0.0:5.1f}%")
    return lines
