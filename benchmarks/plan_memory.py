"""Per-device memory of a config's train step at a mesh, planned before any weight exists.

    python -m benchmarks plan_memory --config configs/zebra_8b.py --fsdp 4 [--data 1] [--context N] \
        [--cpu | --mock-gpus | --gpu h200] \
        [--no-compile] \
        [--config.train.micro_batch_size=1 --config.model.remat=full ...] [--name NAME] [--out DIR]

The train state (float32 weights, AdamW moments, counters) is built abstractly (``build_trainer(...,
abstract=True)``) with the shardings the trainer gives it on a ``data x fsdp x context`` mesh (``mesh.py``'s rules;
``--config.train.zero1=true`` splits the moments over ``data`` too), so nothing is allocated. Two figures:

* ``state``: bytes of the parameters and of the optimizer state that one device holds, from each leaf's
  sharding (``sharding.shard_shape``): exact, and the same arithmetic as the running trainer's arrays.
* ``compiled`` (unless ``--no-compile``): the real jitted train step (``make_train_step``, the config's micro
  batch and accumulation) lowered on those abstract arguments and compiled for the mesh's devices, measured by
  the compiler's ``memory_analysis()``: peak = arguments + outputs - aliased (the donated state) + temporaries,
  per device; ``collectives``: the compiled step's collectives, counted inside loop bodies (per micro-batch) and
  elsewhere (once per step); ``family_gb``: the bytes its kernels read and write per step by op family
  (``op_families.family_bytes``: where a change moves memory traffic, before any GPU times it; with ``--gpu`` the
  GPU compiler's fusions).

``--context`` (default: the config's ``mesh.context``) splits each sequence over that many devices more; the batch
is split over ``data x fsdp`` only. ``--cpu`` compiles for ``data x fsdp x context`` host CPU devices
(``--xla_force_host_platform_device_count``): an indication only, since the CPU compiler fuses, schedules and
rematerializes differently from the GPU one and the Pallas kernels fall back to their XLA form (MLA's then holds
dense ``[B, H, T/context, T]`` scores: ``--config.model.kernel_impl=pallas_interpret`` compiles the kernels'
interpreted form instead); the plan for a GPU run is this command on the GPUs themselves (where it compiles for
the mesh's GPUs without running a step). ``--mock-gpus`` plans a mesh of more GPUs than the machine has: JAX's mock GPU
topology (``jax_mock_gpu_topology = "<n> x 1 x 1"``: ``n`` hosts of one GPU each, this process the first, the others'
collectives mocked) makes the one GPU compile the step for all ``n``; the memory analysis is the compiler's for one
device of the mesh, and nothing runs. ``--gpu SPEC`` plans for GPUs without any: XLA's GPU compiler compiles the
step for ``n`` compile-only devices that a target description gives (``benchmarks/gpu_specs/SPEC.txtpb``, e.g.
``h200``, or a file; JAX's CUDA plugin must be installed: ``scripts/setup.sh dev,cuda``), with the kernels' tables
and choices of that device (``tuning.target_device``), except the attention: ``kernel_impl=auto`` compiles it as the
Pallas flash kernel there, since cuDNN's compiles only against a live GPU. Saves the record
``plan_memory_<model name>_d<data>_f<fsdp>`` (plus ``_c<context>`` with a context axis; or ``--name``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging
from ml_collections import ConfigDict

from benchmarks import configs, record
from benchmarks.hlo_index import HloIndex
from benchmarks.op_families import COLLECTIVES, family_bytes
from hybrid_jax.model import count_params
from hybrid_jax.train.trainer import build_trainer

GIB = 2**30
SPECS = Path(__file__).with_name("gpu_specs")  # XLA GPU target descriptions for --gpu


def shard_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every leaf of ``tree`` (``ShapeDtypeStruct`` or array leaves with a
    ``NamedSharding``): the largest device's share, which for these even splits is every device's."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def full_bytes(tree: Any) -> int:
    """Bytes of every leaf of ``tree`` whole (unsharded)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def plan(config: ConfigDict, devices: list, *, compile_step: bool = True) -> dict:
    """The per-device state bytes of ``config`` on a mesh of ``devices`` and (``compile_step``) the compiled step's
    memory. ``config.train.global_batch_size`` must be the micro batch x accumulation x batch shards the caller wants.
    """
    t0 = time.perf_counter()
    print(f"planning {config.model.name} on {len(devices)} {devices[0].platform} devices", file=sys.stderr, flush=True)
    trainer = build_trainer(config, devices, abstract=True)  # nothing is allocated
    mesh, accum, state = trainer.mesh, trainer.accum, trainer.abstract_state
    t = config.train
    out: dict = dict(
        config=config.model.name, params=count_params(config.model), mesh=dict(mesh.shape), devices=mesh.size,
        device=mesh.devices.flat[0].device_kind, platform=mesh.devices.flat[0].platform, zero1=t.zero1,
        remat=config.model.remat, dtype=config.model.dtype, micro_batch_size=t.micro_batch_size, accum=accum,
        global_batch_size=t.global_batch_size, seq_len=t.seq_len,
        params_gib_total=full_bytes(state["params"]) / GIB,
        opt_state_gib_total=full_bytes(state["opt_state"]) / GIB,
        params_gib_per_device=shard_bytes(state["params"]) / GIB,
        opt_state_gib_per_device=shard_bytes(state["opt_state"]) / GIB,
        state_gib_per_device=shard_bytes(state) / GIB,
        abstract_s=time.perf_counter() - t0,
    )
    if not compile_step:
        return out
    batch = trainer.abstract_batch(t.seq_len, t.global_batch_size, config.data.document_mask)
    print(f"state planned in {out['abstract_s']:.0f} s; lowering the step for {mesh.size} {out['platform']} devices",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    lowered = trainer.step.lower(state, batch)
    t1 = time.perf_counter()
    print(f"lowered in {t1 - t0:.0f} s; compiling (a large step can take minutes)", file=sys.stderr, flush=True)
    compiled = lowered.compile()
    stats = compiled.memory_analysis()
    index = HloIndex(compiled.as_text())
    t2 = time.perf_counter()
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)
    out.update(
        compiled=dict(argument_gib=stats.argument_size_in_bytes / GIB, output_gib=stats.output_size_in_bytes / GIB,
                      alias_gib=stats.alias_size_in_bytes / GIB, temp_gib=stats.temp_size_in_bytes / GIB,
                      peak_gib=peak / GIB, collectives=collective_counts(index),
                      family_gb={k: v / 1e9 for k, v in family_bytes(index).items() if v}),
        lower_s=t1 - t0, compile_s=t2 - t1,
    )
    return out


def gpu_spec(name: str, ap: argparse.ArgumentParser) -> Path:
    """The target description ``--gpu`` names: ``benchmarks/gpu_specs/NAME.txtpb``, or a ``.txtpb`` file."""
    path = Path(name) if name.endswith(".txtpb") else SPECS / f"{name}.txtpb"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SPECS.glob("*.txtpb")))
        ap.error(f"--gpu {name}: no such target description (have {known} in {SPECS}, or give a .txtpb file)")
    return path


def compile_only_gpus(spec: str, n: int, ap: argparse.ArgumentParser) -> list:
    """``n`` compile-only CUDA devices of the target description ``spec`` (a GpuTargetConfigProto in text form), one
    host: the step compiles for them, nothing runs."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(platform="cuda", target_config=spec, topology=f"1x1x{n}").devices
    except NotImplementedError as e:  # no CUDA plugin registered a topology
        ap.error(f"--gpu needs JAX's CUDA plugin to compile for GPUs (scripts/setup.sh dev,cuda, or pip install "
                 f"'jax[cuda13]'): {str(e).splitlines()[0]}")


def collective_counts(index: HloIndex) -> dict[str, dict[str, int]]:
    """``{"in_loops": {op: n}, "elsewhere": {op: n}}``: the collectives (``op_families.COLLECTIVES``) of a compiled
    module, those in a computation a while loop's body reaches (``HloIndex.in_loops``: run once per
    iteration, per micro-batch in the accumulation scan; an async collective's wrapped computation too) apart from
    the rest (an async pair counts once, by its start)."""
    counts: dict[str, dict[str, int]] = {"in_loops": {}, "elsewhere": {}}
    for computation, names in index.computations.items():
        where = counts["in_loops" if computation in index.in_loops else "elsewhere"]
        for name in names:
            op = index.instructions[name].opcode.removesuffix("-start")
            if op in COLLECTIVES:
                where[op] = where.get(op, 0) + 1
    return counts


def summary(result: dict) -> str:
    """One line of the plan: state per device, and the compiled peak when there is one."""
    line = (f"{result['config']} mesh {result['mesh']} on {result['platform']} zero1={result['zero1']} "
            f"remat={result['remat']} micro {result['micro_batch_size']} x {result['seq_len']}: params "
            f"{result['params_gib_per_device']:.2f} + optimizer {result['opt_state_gib_per_device']:.2f} GiB per "
            f"device (of {result['params_gib_total']:.2f} + {result['opt_state_gib_total']:.2f} in all)")
    if "compiled" in result:
        c = result["compiled"]
        line += (f"; compiled step peak {c['peak_gib']:.2f} GiB per device (temporaries {c['temp_gib']:.2f}), "
                 f"compile {result['lower_s'] + result['compile_s']:.0f} s\nbytes read and written per step by op "
                 "family (each operand counted whole): " + ", ".join(
                     f"{k} {v:.1f} GB" for k, v in sorted(c["family_gb"].items(), key=lambda kv: -kv[1])))
    return line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks plan_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a config file (configs/*.py); overrides: --config.KEY=VALUE")
    ap.add_argument("--fsdp", type=int, default=1, help="mesh.fsdp: the parameter-sharding axis")
    ap.add_argument("--data", type=int, default=1, help="mesh.data: the data-parallel axis")
    ap.add_argument("--context", type=int, default=None, help="mesh.context: the sequence split (default: config's)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per device per step")
    ap.add_argument("--cpu", action="store_true", help="compile for the mesh's host CPU devices (indicative)")
    ap.add_argument("--mock-gpus", action="store_true", help="compile the whole mesh on this machine's first GPU "
                    "through JAX's mock GPU topology (one mocked host per device; compile-only)")
    ap.add_argument("--gpu", metavar="SPEC", default=None, help="compile for GPUs this machine does not have: a "
                    "target description, benchmarks/gpu_specs/SPEC.txtpb (h200) or a file (needs JAX's CUDA plugin)")
    ap.add_argument("--no-compile", action="store_true", help="only the state's bytes per device (seconds)")
    ap.add_argument("--name", default="", help="the record's name (default plan_memory_<model>_d<D>_f<F>)")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args, overrides = configs.parse(ap, argv)
    config = configs.load(args.config, overrides)  # starts no backend
    context = config.mesh.get("context", 1) if args.context is None else args.context
    config.mesh.data, config.mesh.fsdp, config.mesh.context = args.data, args.fsdp, context
    n = args.data * args.fsdp * context
    if sum(map(bool, (args.cpu, args.mock_gpus, args.gpu))) > 1:
        ap.error("--cpu, --mock-gpus and --gpu exclude each other")
    spec = gpu_spec(args.gpu, ap) if args.gpu else None
    if args.cpu:  # read when the backend starts, which is below
        os.environ["XLA_FLAGS"] = " ".join(
            [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
            + [f"--xla_force_host_platform_device_count={n}"])
    if args.cpu or spec:
        jax.config.update("jax_platforms", "cpu")
    if spec:  # the CUDA plugin then registers its compiler without looking for a GPU
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    elif args.mock_gpus:  # read when the GPU backend starts, which is below
        jax.config.update("jax_cuda_visible_devices", "0")
        jax.config.update("jax_mock_gpu_topology", f"{n}x1x1")
    logging.set_verbosity(logging.WARNING)
    if args.mock_gpus and jax.devices()[0].platform != "gpu":
        ap.error(f"--mock-gpus compiles for GPUs and this machine has none ({jax.devices()[0].platform}); use --cpu "
                 "for a plan compiled for host CPU devices")
    devices = compile_only_gpus(spec.read_text(), n, ap) if spec else jax.devices()[:n]
    if len(devices) < n:
        ap.error(f"data {args.data} x fsdp {args.fsdp} x context {context} needs {n} devices, this process sees "
                 f"{len(jax.devices())} (--cpu: host CPU devices; --gpu: GPUs it does not have)")
    config.train.global_batch_size = config.train.micro_batch_size * args.accum * args.data * args.fsdp
    flash = spec is not None and config.model.kernel_impl == "auto"
    if flash:  # cuDNN compiles its attention against a live device; every other kernel is as "auto" on the GPU
        config.model.kernel_impl = "pallas"
        print("compile-only GPUs: the attention compiles as the Pallas flash kernel (cuDNN's needs a GPU to compile); "
              "the other kernels as on the GPU", file=sys.stderr, flush=True)
    result = plan(config, devices, compile_step=not args.no_compile)
    if spec:  # the record's gpu is this machine; the step was compiled for the description's
        repo = SPECS.resolve().parent.parent
        where = spec.resolve().relative_to(repo) if spec.resolve().is_relative_to(repo) else spec.name
        result["compiled_for"] = f"{where} (compile-only devices: no GPU ran)"
        if flash:
            result["attention"] = "the Pallas flash kernel (a GPU run's auto picks cuDNN's)"
    print(summary(result), flush=True)
    print(json.dumps(result, indent=1), flush=True)
    name = f"plan_memory_{config.model.name}_d{args.data}_f{args.fsdp}" + (f"_c{context}" if context > 1 else "")
    suffix = "_mock" if args.mock_gpus else f"_{spec.stem}" if spec else ""
    record.save(args.name or name + suffix, result, out=args.out)


if __name__ == "__main__":
    main()
