"""Compile our Pallas kernels for a GPU that is not there, and report what each launch needs.

    python -m benchmarks kernel_resources [--arch sm90 gfx942 gfx950] [--only kda_anchor ...] [--attention]
                                          [--variant grad.num_warps=4 ...] [--documents]
    ncu --section LaunchStats python -m benchmarks kernel_resources --run --only kda_1b   (on the GPU: the same
                                          launches, once each, for Nsight Compute to measure)

Each kernel is lowered as on the device: forward + backward, the table's launches for the target arch. Its Triton
IR then goes through the ``triton`` package's compiler (PTX and SASS for sm90, AMDGCN for gfx942 / gfx950), with no
GPU. ``--variant`` (``kernels.tuning.override``'s syntax) also compiles the recurrent kernels with changed
launches or options; ``--documents``: with packed documents (``segment_ids``) as well. Per launch it prints:
- the registers per thread, and the spill instructions (SASS ``STL`` / ``LDL``) or AMDGCN's VGPR spill count;
- the shared memory (LDS) against the target's, flagging a launch that could not start there;
- on sm90, the SASS instruction count, the barriers, the tensor-core instructions (``HMMA``; ``HGMMA`` is
  wgmma) and the most frequent opcodes.

The ``triton`` package is not the Triton inside jaxlib that compiles these kernels on the device, so the numbers
approximate the device's (benchmarks/NOTES.md, "Offline compiles against the device"; ``--run`` above measures the
device's; ``tests/kernels/test_kernel_resources.py`` pins both).
Needs ``triton`` (installed with the ``export`` extra's torch on Linux).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.shapes import ATTENTION_SHAPES, SHAPES
from hybrid_jax.kernels.tooling.lowering import TARGETS, Kernel, kernel_case, lowered_kernels
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tuning import current_arch, recurrent_config

# arch -> (Triton target backend, target arch, threads per warp); the device each arch lowers for: lowering.TARGETS
COMPILE_TARGETS = {"sm90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64), "gfx950": ("hip", "gfx950", 64)}


@dataclasses.dataclass(frozen=True)
class Resources:
    """What a compiled launch needs. ``spills``: spill instructions (sm90) or spilled VGPRs (AMD);
    ``opcodes``: SASS opcode counts (sm90 only, else empty)."""

    registers: int
    spills: int
    shared: int
    opcodes: collections.Counter


def compile_kernel(kernel: Kernel, arch: str) -> Resources:
    """Compile ``kernel`` with the ``triton`` package for ``arch`` (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    backend, target_arch, warp_size = COMPILE_TARGETS[arch]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(path, "w") as f:
            f.write(kernel.ir)
        compiled = triton.compile(path, target=GPUTarget(backend, target_arch, warp_size),
                                  options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages))
        shared = compiled.metadata.shared
        if backend == "hip":
            gcn = compiled.asm["amdgcn"]
            count = lambda key: int(re.search(rf"\.{key}:\s+(\d+)", gcn).group(1))
            return Resources(count("vgpr_count"), count("vgpr_spill_count"), shared, collections.Counter())
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    opcodes = collections.Counter(m.group(1) for m in re.finditer(
        r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    return Resources(registers, opcodes["STL"] + opcodes["LDL"], shared, opcodes)


def recurrence_case(s: Problem, arch: str, variant: str = "", T: int = 512, documents: bool = False
                    ) -> tuple[Callable, tuple]:
    """Forward + backward of the recurrent kernels at problem ``s`` as one sequence of ``T`` tokens (the launches'
    resources do not depend on B or T) with ``arch``'s table entry, changed by ``variant`` if given;
    ``documents``: with ``segment_ids`` (an int32 argument)."""
    return kernel_case(dataclasses.replace(s, B=1, T=T), arch, variant, segments=documents)


def report(label: str, fn: Callable, args: tuple, arch: str) -> None:
    """Compile and print every launch of ``fn`` for ``arch``."""
    limit = recurrent_config(arch).shared_memory
    for kernel in lowered_kernels(fn, args, arch):
        r = compile_kernel(kernel, arch)
        flag = "  OVER the shared memory" if r.shared > limit else ""
        line = (f"{arch:7s} {label:22s} {kernel.name:14s} {kernel.num_warps:2d} warps {kernel.num_stages} stages  "
                f"regs {r.registers:3d}  spills {r.spills:4d}  shared {r.shared:6d} / {limit}{flag}")
        if r.opcodes:
            top = " ".join(f"{op}:{n}" for op, n in r.opcodes.most_common(8))
            mma = r.opcodes["HMMA"] + r.opcodes["HGMMA"]
            line += f"\n{'':8s}SASS {sum(r.opcodes.values())} (BAR {r.opcodes['BAR']}, HMMA/HGMMA {mma}): {top}"
        print(line, flush=True)


def run_on_device(only: list[str] | None, variants: list[str]) -> None:
    """One forward + backward of each recurrent case (:func:`recurrence_case`) on the default device, with random
    inputs, so that a profiler sees the launches that this tool compiles offline."""
    arch = current_arch()
    for s in SHAPES:
        if only is None or s.name in only:
            for variant in ["", *variants]:
                fn, args = recurrence_case(s, arch, variant)
                keys = jax.random.split(jax.random.key(0), len(args))
                x = [jax.random.normal(key, a.shape, a.dtype) for key, a in zip(keys, args, strict=True)]
                x[3] = -jnp.abs(x[3]) / 16  # a decaying gate (log space)
                value, _ = jax.block_until_ready(jax.jit(fn)(*x))
                print(f"{arch} {s.name} {variant}: ran, loss {float(value):.4g}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernel_resources", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--only", nargs="+", default=None, help="recurrent shapes (benchmarks/shapes.py), default all")
    ap.add_argument("--attention", action="store_true", help="also the attention shapes")
    ap.add_argument("--variant", action="append", default=[], help="FIELD=V[,KERNEL.FIELD=V] (benchmarks/kernels.py)")
    ap.add_argument("--documents", action="store_true", help="also each recurrent case with packed documents")
    ap.add_argument("--run", action="store_true",
                    help="instead, run each recurrent case once on this machine's GPU (table of its arch), for a "
                         "profiler to measure the launches: ncu --section LaunchStats python -m ... --run")
    args = ap.parse_args(argv)
    if args.run:
        run_on_device(args.only, args.variant)
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("kernel_resources needs the triton package (pip install triton; torch brings it)") from None
    for arch in args.arch:
        for s in SHAPES:
            if args.only is None or s.name in args.only:
                for variant in ["", *args.variant]:
                    for docs in (False, True) if args.documents else (False,):
                        label = f"{s.name} {variant}{' documents' if docs else ''}".strip()
                        report(label, *recurrence_case(s, arch, variant, documents=docs), arch)
        if args.attention:
            for p in ATTENTION_SHAPES:
                report(f"attention H{p.H} {p.K}/{p.V}", *kernel_case(dataclasses.replace(p, B=1), arch), arch)


if __name__ == "__main__":
    main()
