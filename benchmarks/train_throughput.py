"""Training throughput of a config: the real jitted train step on mock data, no checkpoints.

    python -m benchmarks train --config configs/zebra_300m_gdn.py [--steps 20] [--warmup 3] [--accum 1] \
        [--devices N] [--config.train.micro_batch_size=32 ...] [--name NAME] [--out DIR] [--profile DIR]

The global batch is set to ``micro_batch_size x accum x devices`` (one optimizer step = ``accum`` micro-batches
per device) so a step takes seconds, not minutes. ``--devices N``: a mesh over the first N devices (default all;
``--devices 1`` then all is the data-parallel scaling, with ``--config.train.zero1=true`` for ZeRO-1). Prints one
JSON object and saves it as the record ``train_<model name>`` (or ``--name``): tokens/s, tokens/s/device, MFU
(``hybrid_jax.flops``), step time, peak device memory, the parameters and optimizer state held per device (ZeRO-1
shards the latter), the first and last loss and the number of skipped steps. Timed steps exclude the ``--warmup``
steps (compilation included there). ``--profile DIR``: the summary of a trace of ``--profile-steps`` more steps
(``benchmarks/trace_summary.py``) is printed and kept in the record as ``profile``, with ``profile.families`` the
device time per step by op family and the TFLOP/s of the matmul families (``benchmarks/op_families.py``), and
``profile.outside_matmuls_ms`` the time per step outside their matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
from absl import logging

from benchmarks import configs, record
from hybrid_jax.data import DataStream
from hybrid_jax.flops import flops_per_token, peak_flops
from hybrid_jax.kernels import tuning_file
from hybrid_jax.model import count_params
from hybrid_jax.train.report.metrics import device_memory_gib
from hybrid_jax.train.trainer import build_trainer


def resident_gib(tree) -> float:
    """GiB of ``tree``'s arrays held on the first local device (its shard of each sharded array)."""
    device = jax.local_devices()[0]
    return (
        sum(
            shard.data.nbytes
            for leaf in jax.tree.leaves(tree)
            for shard in leaf.addressable_shards
            if shard.device == device
        )
        / 2**30
    )


def benchmark(config, *, steps: int, warmup: int, profile: str = "", profile_steps: int = 3,
              devices: list | None = None) -> dict:
    t0 = time.perf_counter()
    launch_configs = tuning_file.use(config.model.tuning)  # as the trainer's start-up chooses them
    trainer = build_trainer(config, devices)
    mesh, accum, state, step = trainer.mesh, trainer.accum, trainer.state, trainer.step
    data = DataStream.open(config, process_index=jax.process_index(), process_count=jax.process_count())

    def run(n: int, fn=step) -> list[dict]:
        nonlocal state
        out = []
        for _ in range(n):
            state, metrics = fn(state, trainer.put(next(data)))
            out.append(metrics)
        return jax.device_get(out)

    params_gib, opt_state_gib = resident_gib(state["params"]), resident_gib(state["opt_state"])
    first = run(warmup)
    setup_s = time.perf_counter() - t0
    half = steps // 2  # timed in two halves (each ends on the device): whether the step time is steady
    t0 = time.perf_counter()
    timed = run(half)
    t1 = time.perf_counter()
    timed += run(steps - half)
    t2 = time.perf_counter()
    seconds = t2 - t0
    halves = [(t1 - t0) / half, (t2 - t1) / (steps - half)] if half else None
    trace = None
    if profile:
        from benchmarks.trace_summary import HLO_FILE, format_summary, summarize

        # The traced steps run a second compile of the step without CUDA command buffers: inside a command buffer
        # every kernel's trace event names the buffer, not its HLO op. That HLO (saved) names each op's JAX scope.
        batch = trainer.put(next(data))
        traced = step.lower(state, batch).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
        Path(profile).mkdir(parents=True, exist_ok=True)
        (Path(profile) / HLO_FILE).write_text(traced.as_text())
        run(1, traced)  # warm-up
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            run(profile_steps, traced)
        trace = summarize(profile, hlo=Path(profile) / HLO_FILE, steps=profile_steps)
        text = format_summary(trace)
        print(text, flush=True)
        (Path(profile) / "trace_summary.txt").write_text(text + "\n")
        (Path(profile) / "event_args_sample.json").write_text(json.dumps(trace["arg_sample"], indent=1))
    tokens = steps * config.train.global_batch_size * config.train.seq_len
    per_device = tokens / seconds / mesh.size
    fpt = flops_per_token(config.model, config.train.seq_len)
    peak = peak_flops(jax.devices()[0])
    _, peak_memory = device_memory_gib()
    metrics = first + timed
    return dict(
        config=config.model.name,
        params=count_params(config.model),
        device=jax.devices()[0].device_kind,
        devices=mesh.size,
        jax=jax.__version__,
        kernel_impl=config.model.kernel_impl,
        launch_configs=launch_configs,
        xla_options=step.xla_options,  # the step's compile options (train_step.STEP_XLA_OPTIONS)
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        dtype=config.model.dtype,
        remat=config.model.remat,
        micro_batch_size=config.train.micro_batch_size,
        accum=accum,
        seq_len=config.train.seq_len,
        steps=steps,
        step_s=seconds / steps,
        step_s_halves=halves,
        tokens_per_s=tokens / seconds,
        tokens_per_s_per_device=per_device,
        flops_per_token=fpt,
        tflops_per_s_per_device=per_device * fpt / 1e12,
        mfu=per_device * fpt / peak if peak else None,
        zero1=config.train.zero1,
        peak_memory_gib=peak_memory,
        params_gib_per_device=params_gib,
        opt_state_gib_per_device=opt_state_gib,
        setup_and_warmup_s=setup_s,
        loss_first=float(metrics[0]["loss"]),
        loss_last=float(metrics[-1]["loss"]),
        skipped=int(metrics[-1]["skipped"]),
        profile=trace,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a config file (configs/*.py); overrides: --config.KEY=VALUE")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per device per step")
    ap.add_argument("--devices", type=int, default=0, help="a mesh over the first N devices (0: all)")
    ap.add_argument("--name", default="", help="the record's name (default train_<model name>)")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    ap.add_argument("--profile", default="", help="after the timed steps, trace --profile-steps more into this "
                    "directory (with the step's HLO text) and print where the device time goes, by op family too "
                    "(benchmarks/trace_summary.py; also written there with a sample of the events' args)")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps traced with --profile")
    args, overrides = configs.parse(ap, argv)
    logging.set_verbosity(logging.WARNING)
    config = configs.load(args.config, overrides)
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    config.train.global_batch_size = config.train.micro_batch_size * args.accum * len(devices)
    result = benchmark(config, steps=args.steps, warmup=args.warmup, profile=args.profile,
                       profile_steps=args.profile_steps, devices=devices)
    print(json.dumps(result, indent=1), flush=True)
    if jax.process_index() == 0:
        record.save(args.name or f"train_{config.model.name}", result, out=args.out)


if __name__ == "__main__":
    main()
