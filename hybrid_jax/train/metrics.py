"""Metrics every ``train.log_every`` steps: a rich console line, TensorBoard scalars, ``metrics.jsonl``.

Each logged step is one JSON line with ``step, loss, grad_norm, lr, tokens_per_s, tokens_per_s_per_device,
mfu, memory_gib, peak_memory_gib, skipped`` (``mfu`` and the memory fields are null where the device does
not report them, e.g. CPU). Throughput is measured between log points, over whole steps: the time of the
steps since the previous log, after the device finished them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
from rich.console import Console
from tensorboardX import SummaryWriter

from hybrid_jax.flops import peak_flops

GIB = 2**30


def device_memory_gib() -> tuple[float | None, float | None]:
    """``(bytes in use, peak bytes in use)`` of this process's first device in GiB, or Nones if unreported."""
    stats = jax.local_devices()[0].memory_stats() or {}
    use, peak = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    return (use / GIB if use is not None else None), (peak / GIB if peak is not None else None)


class MetricsLogger:
    """Writes the logs of process 0 (other processes only keep time). Call :meth:`log` with host values."""

    def __init__(self, workdir: str | Path, *, flops_per_token: float, tokens_per_step: int, total_steps: int):
        self.enabled = jax.process_index() == 0
        self.flops_per_token, self.tokens_per_step, self.total_steps = flops_per_token, tokens_per_step, total_steps
        self.n_devices = jax.device_count()
        self.peak = peak_flops(jax.devices()[0])
        self.console = Console(highlight=False)
        self._since: tuple[int, float] | None = None
        if self.enabled:
            self.jsonl = open(Path(workdir) / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            self.tb = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def start_clock(self, step: int) -> None:
        """Measure throughput from now, when ``step`` has just finished on the device."""
        self._since = (step, time.perf_counter())

    def log(self, step: int, values: dict[str, float]) -> dict:
        """Record ``values`` (loss, grad_norm, lr, skipped, ... as Python numbers) at ``step``; returns the record."""
        now = time.perf_counter()
        tokens_per_s = None
        if self._since is not None and step > self._since[0]:
            tokens_per_s = (step - self._since[0]) * self.tokens_per_step / (now - self._since[1])
        self._since = (step, now)
        memory, peak_memory = device_memory_gib()
        per_device = tokens_per_s / self.n_devices if tokens_per_s is not None else None
        mfu = per_device * self.flops_per_token / self.peak if per_device is not None and self.peak else None
        record = dict(step=step, **values, tokens_per_s=tokens_per_s, tokens_per_s_per_device=per_device, mfu=mfu,
                      memory_gib=memory, peak_memory_gib=peak_memory)
        if self.enabled:
            self._write(record)
        return record

    def warn(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"[bold yellow]warning:[/] {message}")

    def _write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self.tb.add_scalar(f"train/{key}", value, record["step"])
        self.tb.flush()
        fmt = lambda key, spec: "-" if record.get(key) is None else format(record[key], spec)
        self.console.print(
            f"step {record['step']:>6}/{self.total_steps}  loss {fmt('loss', '.4f')}  "
            f"grad_norm {fmt('grad_norm', '.3f')}  lr {fmt('lr', '.2e')}  "
            f"tok/s/dev {fmt('tokens_per_s_per_device', ',.0f')}  mfu {fmt('mfu', '.1%')}  "
            f"mem {fmt('memory_gib', '.1f')} GiB  skipped {record.get('skipped', 0)}",
            soft_wrap=True,
        )

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()
