"""One instruction of an optimized HLO module text (``compiled.as_text()``): its parts (result shape, opcode,
operands, attributes), the dims and bytes of its arrays, and the FLOPs of the matmuls it runs. Used by
:mod:`benchmarks.hlo_index`."""

from __future__ import annotations

import math
import re


def parts(rest: str) -> tuple[str, str, str, str]:
    """An instruction's right-hand side split as ``(result shape, opcode, operands, attributes)``:
    ``(bf16[8,32]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target=...`` -> ``("(bf16[8,32]{1,0}, s8[0]{0})",
    "custom-call", "%a, %b", ", custom_call_target=...")``."""
    if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
        end = _closing(rest, 0) + 1
    else:
        end = rest.find(" ") if " " in rest else len(rest)
    m = re.match(r"\s*([\w\-]+)\(", rest[end:])
    if not m:
        return rest[:end], "?", "", rest[end:]
    start = end + m.end() - 1
    close = _closing(rest, start)
    return rest[:end], m.group(1), rest[start + 1:close], rest[close + 1:]


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``text[start]`` (the end of ``text`` if none)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def array_bytes(shape: str) -> list[int]:
    """The bytes of each array in a shape's text: ``(bf16[8,32]{1,0}, f32[4]{0})`` -> ``[512, 16]`` (4 per element
    of an unknown type)."""
    return [DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in re.findall(r"\d+", text))
            for dtype, text in re.findall(r"\b([a-z]\w*)\[([^\]]*)\]", shape)]


def operand_bytes(arrays: list[int], index: str) -> int:
    """An operand's bytes: ``%x#1`` (a tuple's element ``1``, in the printer's short form) its array's, ``%x`` all."""
    return arrays[int(index)] if index and int(index) < len(arrays) else sum(arrays)


def array_dims(shape: str) -> list[tuple[int, ...]]:
    """The dims of each array in a shape's text: ``(bf16[8,32]{1,0}, s8[0]{0})`` -> ``[(8, 32), (0,)]``."""
    return [tuple(int(d) for d in re.findall(r"\d+", text)) for text in re.findall(r"\b[a-z]\w*\[([^\]]*)\]", shape)]


def operand_dims(operands: str, shapes: dict[str, list[tuple[int, ...]]]) -> list[tuple[int, ...] | None]:
    """Each operand's dims, from its shape when the text prints it (``f32[2,3]{1,0} %a``), else from the shape of
    the instruction it names (the optimized text names operands only); None when unknown."""
    out: list[tuple[int, ...] | None] = []
    for operand in _top_level_split(re.sub(r"/\*.*?\*/", "", operands)):
        if found := array_dims(operand.split("%")[0] if "%" in operand else ""):
            out.append(found[0])
        elif (m := re.search(r"%?([\w.\-]+)\s*$", operand)) and shapes.get(m.group(1)):
            out.append(shapes[m.group(1)][0])
        else:
            out.append(None)
    return out


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts + [text[start:]] if p.strip()]


def matmul_flops(opcode: str, attrs: str, result: list[tuple[int, ...]],
                 operands: list[tuple[int, ...] | None]) -> float:
    """FLOPs of one instruction's matmuls, from its attributes, result dims and operand dims (0 when it runs none or
    a shape is unknown):

    * a ``dot`` or a cuBLAS / hipBLAS gemm custom call (``dot_dimension_numbers`` in its backend config):
      ``2 x`` the result's elements (batch and free dims) ``x`` the contracted size of the left operand;
    * cuDNN fused attention (``cudnn_fmha_backend_config``): ``2 x S (Dqk + Dv)`` forward, with ``S = B H Tq Tk``
      its score tensor (``intermediate_tensor_shape``), ``Dqk`` from q and ``Dv`` from the output; the backward is
      counted as twice the forward and a causal mask halves both, as ``hybrid_jax.flops`` counts training.
    """
    if opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
    elif "cudnn_fmha_backend_config" in attrs:
        return _attention_flops(attrs, result, operands)
    elif '"dot_dimension_numbers"' in attrs:
        contracting = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', attrs)
    else:
        return 0.0
    lhs = operands[0] if operands else None
    if not contracting or lhs is None or not result:
        return 0.0
    return 2.0 * math.prod(result[0]) * math.prod(lhs[int(i)] for i in re.findall(r"\d+", contracting.group(1)))


def _attention_flops(attrs: str, result: list[tuple[int, ...]], operands: list[tuple[int, ...] | None]) -> float:
    """FLOPs of a cuDNN fused attention call (:func:`matmul_flops`): the forward's results are ``(o, [stats],
    workspace)``, the backward's ``(dq, dk, dv, ...)``."""
    scores = re.search(r'"intermediate_tensor_shape".*?"dimensions"\s*:\s*\[([^\]]*)\]', attrs)
    if not scores:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", scores.group(1))]
    rows = math.prod(dims[:-1])  # B H Tq
    if re.search(r'custom_call_target="[^"]*Backward', attrs):
        if len(result) < 3 or not math.prod(result[1]):
            return 0.0
        d_qk = math.prod(result[0]) / rows  # dq: [B, Tq, H, Dqk] in some order
        d_v = d_qk * math.prod(result[2]) / math.prod(result[1])  # dv / dk: Dv / Dqk, whatever the kv heads
        passes = 2
    else:
        if not result or not operands or operands[0] is None:
            return 0.0
        d_qk, d_v, passes = math.prod(operands[0]) / rows, math.prod(result[0]) / rows, 1
    flops = 2.0 * passes * math.prod(dims) * (d_qk + d_v)
    return flops / 2 if re.search(r'"mask_type"\s*:\s*"\w*CAUSAL', attrs) else flops
