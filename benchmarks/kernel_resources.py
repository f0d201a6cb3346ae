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
approximate the device's. On the H200 at the 1B KDA shape, Nsight Compute measured 64 / 72 registers for
``grad_bwd`` / ``grad_wy_bwd`` where this tool reports the same, but 196 for ``grad_bwd_levels`` where it reports
166 (``--run`` above; ``tests/kernels/test_kernel_resources.py`` pins both).
Needs ``triton`` (installed with the ``export`` extra's torch on Linux).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from benchmarks.shapes import ATTENTION_SHAPES, SHAPES, Shape
from hybrid_jax.kernels.flash_attention import flash_attention
from hybrid_jax.kernels.recurrent import chunk_recurrence
from hybrid_jax.kernels.tuning import attention_config, current_arch, override, recurrent_config

# arch -> (device kind, JAX platform, Triton target backend, target arch, threads per warp)
TARGETS = {
    "sm90": ("NVIDIA H200", "cuda", "cuda", 90, 32),
    "gfx942": ("gfx942", "rocm", "hip", "gfx942", 64),
    "gfx950": ("gfx950", "rocm", "hip", "gfx950", 64),
}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Pallas launch as lowered for a target: its Triton IR (text) and launch parameters."""

    name: str
    ir: str
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class Resources:
    """What a compiled launch needs. ``spills``: spill instructions (sm90) or spilled VGPRs (AMD);
    ``opcodes``: SASS opcode counts (sm90 only, else empty)."""

    registers: int
    spills: int
    shared: int
    opcodes: collections.Counter


@contextlib.contextmanager
def _captured_triton_ir() -> Iterator[list[str]]:
    """The Triton IR text of every Pallas kernel lowered inside the block. Pallas keeps the module only as bytecode
    in the custom call, which another Triton version cannot read, so the lowering function is wrapped."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    texts: list[str] = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield texts
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower


def lowered_kernels(fn: Callable, args: tuple, arch: str) -> list[Kernel]:
    """The Pallas launches of ``fn(*args)`` lowered for ``arch``, in order, each kernel once (by name: two different
    kernels under one name are an error, since a report by name could not tell them apart)."""
    kind, platform = TARGETS[arch][:2]
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(kind, 1, platform))
    with _captured_triton_ir() as texts, jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    # name -> (num_warps, num_stages): the Triton custom calls' backend configs list their keys in this order
    launches = {name: (int(warps), int(stages)) for name, stages, warps in re.findall(
        r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    kernels: dict[str, Kernel] = {}
    for ir in dict.fromkeys(texts):
        name = re.search(r"tt\.func (?:public )?@(\w+)", ir).group(1)
        if name in kernels:
            raise ValueError(f"two different Pallas kernels are named {name!r}: give each launch its own name")
        kernels[name] = Kernel(name, ir, *launches[name])
    return list(kernels.values())


def compile_kernel(kernel: Kernel, arch: str) -> Resources:
    """Compile ``kernel`` with the ``triton`` package for ``arch`` (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    backend, target_arch, warp_size = TARGETS[arch][2:]
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


def _sds(*shape, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def recurrence_case(s: Shape, arch: str, variant: str = "", T: int = 512, documents: bool = False
                    ) -> tuple[Callable, tuple]:
    """Forward + backward of ``chunk_recurrence`` at shape ``s`` (one sequence of ``T`` tokens: the launches'
    resources do not depend on B or T) with ``arch``'s table entry, changed by ``variant`` if given;
    ``documents``: with ``segment_ids`` (an int32 argument)."""
    config = recurrent_config(arch, per_key=s.per_key)
    config = override(config, variant) if variant else config
    g_shape = (1, T, s.HV, s.K) if s.per_key else (1, T, s.HV)
    args = (_sds(1, T, s.H, s.K), _sds(1, T, s.H, s.K), _sds(1, T, s.HV, s.V), _sds(*g_shape, dtype=jnp.float32),
            _sds(1, T, s.HV)) + ((_sds(1, T, dtype=jnp.int32),) if documents else ())

    def loss(q, k, v, g, beta, segment_ids=None):
        o, _ = chunk_recurrence(q, k, v, g, beta if s.delta else None, use_qk_l2norm=True, config=config,
                                segment_ids=segment_ids)
        return o.astype(jnp.float32).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), args  # the value too: grad alone drops the output pass


def attention_case(dims: tuple[int, int, int, int, int], arch: str) -> tuple[Callable, tuple]:
    """Forward + backward of ``flash_attention`` at ``(B, T, H, Dqk, Dv)`` (one sequence) with ``arch``'s tiles."""
    _, T, H, dqk, dv = dims
    config = attention_config(arch, max(dqk, dv))

    def loss(q, k, v):
        return flash_attention(q, k, v, config=config).astype(jnp.float32).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2)), (_sds(1, T, H, dqk), _sds(1, T, H, dqk), _sds(1, T, H, dv))


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
            for dims in ATTENTION_SHAPES.values():
                report(f"attention H{dims[2]} {dims[3]}/{dims[4]}", *attention_case(dims, arch), arch)


if __name__ == "__main__":
    main()
