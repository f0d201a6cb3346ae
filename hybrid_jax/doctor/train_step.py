"""One training step of a config on this device: the real jitted step (``hybrid_jax.train``) on mock data, at the
config's micro batch or the largest that fits (halved on out-of-memory), timed after warm-up."""

from __future__ import annotations

import gc
import time

import jax
from flax import nnx

from hybrid_jax.data import make_train_iterator
from hybrid_jax.flops import flops_per_token, peak_flops
from hybrid_jax.model import HybridLM
from hybrid_jax.train import mesh as mesh_lib
from hybrid_jax.train.metrics import device_memory_gib
from hybrid_jax.train.optim import make_optimizer
from hybrid_jax.train.step import init_state, make_train_step
from hybrid_jax.train.validate import validate


def _oom(e: BaseException) -> bool:
    text = str(e).lower()
    return "resource_exhausted" in text or "out of memory" in text


def _measure(config, *, steps: int, warmup: int) -> dict:
    device = jax.devices()[0]
    mesh = mesh_lib.make_mesh(config.mesh, [device])
    accum = validate(config, mesh_lib.batch_shards(mesh))
    tx = make_optimizer(config.train)
    graphdef, state, shardings = init_state(lambda: HybridLM(config.model, rngs=nnx.Rngs(config.train.seed)), tx,
                                            mesh, zero1=False, seed=config.train.seed)
    step = make_train_step(graphdef, tx, config.train, mesh, shardings, accum=accum)
    data = make_train_iterator(config)
    sharding = mesh_lib.batch_sharding(mesh)
    batches = [jax.device_put(next(data), sharding) for _ in range(2)]
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
    config.data.source, t = "mock", config.train
    micro, notes = t.micro_batch_size, []
    while True:
        t.micro_batch_size = t.global_batch_size = micro
        try:
            out = _measure(config, steps=steps, warmup=warmup)
            break
        except Exception as e:  # noqa: BLE001 - said in the report
            gc.collect()
            jax.clear_caches()
            if not _oom(e) or micro == 1:
                return dict(config=config.model.name, ok=False, micro_batch_size=micro, notes=notes,
                            error=" ".join(f"{type(e).__name__}: {e}".split())[:300])
            notes.append(f"micro batch {micro} does not fit: halved")
            micro //= 2
    ok = out["finite"]
    return dict(config=config.model.name, ok=ok, kernel_impl=config.model.kernel_impl, micro_batch_size=micro,
                seq_len=t.seq_len, notes=notes, **out, **({} if ok else {"error": "the loss is not finite"}))
