"""One training step of a config on this device: the real jitted step (``hybrid_jax.train``) on mock data, at the
config's micro batch or the largest that fits (halved on out-of-memory), timed after warm-up."""

from __future__ import annotations

import gc
import time

import jax

from hybrid_jax.data import DataStream
from hybrid_jax.flops import flops_per_token, peak_flops
from hybrid_jax.train.report.metrics import device_memory_gib
from hybrid_jax.train.stops import is_out_of_memory
from hybrid_jax.train.trainer import build_trainer


def _measure(config, *, steps: int, warmup: int) -> dict:
    device = jax.devices()[0]
    trainer = build_trainer(config, [device])
    state, step = trainer.state, trainer.step
    data = DataStream(config, None)
    batches = [trainer.put(next(data)) for _ in range(2)]
    data.close()
    t0 = time.perf_counter()
    for i in range(warmup):
        state, metrics = step(state, batches[i % 2])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batches[i % 2])
    metrics = jax.device_get(metrics)
    seconds = (time.perf_counter() - t0) / steps
    tokens = config.train.micro_batch_size * config.train.seq_len / seconds
    peak = peak_flops(device)
    fpt = flops_per_token(config.model, config.train.seq_len)
    peak_gib = device_memory_gib()[1]  # of the process: the kernel checks before take far less
    return dict(step_s=round(seconds, 4), tokens_per_s=round(tokens, 1),
                mfu=round(tokens * fpt / peak, 4) if peak else None, peak_memory_gib=peak_gib and round(peak_gib, 2),
                warmup_s=round(compile_s, 2), loss=float(metrics["loss"]), finite=bool(metrics["finite"]))


def train_step(config, *, steps: int = 5, warmup: int = 2) -> dict:
    """tokens/s, MFU (``hybrid_jax.flops``), step time and peak device memory of one device's training step of
    ``config``, at its micro batch halved until it fits. ``ok`` False with ``error`` when no batch runs."""
    config = config.copy_and_resolve_references()
    config.data.source, config.train.zero1, t = "mock", False, config.train
    micro, notes = t.micro_batch_size, []
    while True:
        t.micro_batch_size = t.global_batch_size = micro
        try:
            out = _measure(config, steps=steps, warmup=warmup)
            break
        except Exception as e:  # noqa: BLE001 - said in the report
            gc.collect()
            jax.clear_caches()
            if not is_out_of_memory(e) or micro == 1:
                return dict(config=config.model.name, ok=False, micro_batch_size=micro, notes=notes,
                            error=" ".join(f"{type(e).__name__}: {e}".split())[:300])
            notes.append(f"micro batch {micro} does not fit: halved")
            micro //= 2
    ok = out["finite"]
    return dict(config=config.model.name, ok=ok, kernel_impl=config.model.kernel_impl, micro_batch_size=micro,
                seq_len=t.seq_len, notes=notes, **out, **({} if ok else {"error": "the loss is not finite"}))
