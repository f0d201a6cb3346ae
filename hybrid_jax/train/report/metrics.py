"""Metrics every ``train.log_every`` steps: a console line, TensorBoard scalars, ``metrics.jsonl``.

Each logged step is one JSON line with ``step, loss, grad_norm, lr, tokens_per_s, tokens_per_s_per_device,
mfu, memory_gib, peak_memory_gib, skipped`` (``mfu`` and the memory fields are null where the device does
not report them, e.g. CPU); a run on a blend of datasets adds ``data_tokens/LABEL`` per dataset, the tokens it
gave so far (:meth:`~hybrid_jax.data.pipeline.DataStream.source_tokens`; TensorBoard ``train/data_tokens/LABEL``).
Throughput is measured between log points, over whole steps: the time of the steps since the previous log, after the
device finished them. A validation is its own line,
``{"step", "val_loss", "val_ppl"}`` (TensorBoard ``val/loss``, ``val/ppl``), and so is a task evaluation
(``train.eval_tasks``), ``{"step", "eval/TASK/METRIC", ..., "eval_seconds"}`` (TensorBoard ``eval/TASK/METRIC``). The
seconds of both are left out of the throughput.

With ``train.wandb_project`` (and the ``wandb`` package) every row also goes to Weights & Biases under the same
names (training values as ``train/NAME``), from process 0; :func:`start_wandb` starts the W&B run. TensorBoard
stays the default and is always written.

On resume from step ``N`` the lines past ``N`` (written by the run that was interrupted after its checkpoint) are
dropped from ``metrics.jsonl`` and TensorBoard is told to purge its points past ``N`` (``purge_step``), so every
step appears once and the plots have no doubled segment. A line that is not JSON (the cut last write of a killed
run) is dropped too, with a note. W&B cannot drop points: a resumed run continues the same W&B run (its id comes from
the workdir) and W&B ignores the steps it already has, which an exact resume computes again to the same values.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
from ml_collections import ConfigDict
from rich.console import Console
from tensorboardX import SummaryWriter

from hybrid_jax.checkpoints.layout import METRICS, TENSORBOARD
from hybrid_jax.checkpoints.storage import storage_error
from hybrid_jax.flops import peak_flops

GIB = 2**30


def device_memory_gib() -> tuple[float | None, float | None]:
    """``(bytes in use, peak bytes in use)`` of this process's first device in GiB, or Nones if unreported."""
    stats = jax.local_devices()[0].memory_stats() or {}
    use, peak = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    return (use / GIB if use is not None else None), (peak / GIB if peak is not None else None)


def _row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def drop_rows_after(path: Path, step: int) -> tuple[int, int]:
    """Rewrite the ``metrics.jsonl`` at ``path`` without the rows past ``step`` and without lines that are not JSON
    rows (atomically); returns how many of each were dropped."""
    if not path.is_file():
        return 0, 0
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = [(line, _row(line)) for line in lines]
    kept = [line for line, row in rows if row is not None and row.get("step", 0) <= step]
    unreadable = sum(row is None for _, row in rows)
    if len(kept) < len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept) - unreadable, unreadable


def start_wandb(config: ConfigDict) -> Any:
    """The Weights & Biases run of ``train.wandb_project`` in ``train.wandb_mode`` (None when it is empty, and on
    processes other than 0): named after the workdir, its id derived from the workdir's path so that a resumed run
    continues it, its files under ``WORKDIR/wandb``, the run config as its config."""
    t = config.train
    if not t.wandb_project or jax.process_index() != 0:
        return None
    import wandb

    workdir = Path(t.workdir).resolve()
    run_id = hashlib.sha256(str(workdir).encode()).hexdigest()[:16]
    return wandb.init(project=t.wandb_project, name=workdir.name, id=run_id, resume="allow", dir=str(workdir),
                      mode=t.wandb_mode, config=config.to_dict(), settings=wandb.Settings(console="off", quiet=True))


class MetricsLogger:
    """Writes the logs of process 0 (other processes only keep time). Call :meth:`log` with host values.

    ``resume_step``: the step the run restarts from (see the module docstring); ``console``: where the lines go
    (the progress display's, so that they print above its bar); ``wandb_run``: a W&B run to log to as well
    (:func:`start_wandb`), finished by :meth:`close`.
    """

    def __init__(self, workdir: str | Path, *, flops_per_token: float, tokens_per_step: int, total_steps: int,
                 resume_step: int | None = None, console: Console | None = None, wandb_run: Any = None):
        self.enabled = jax.process_index() == 0
        self.wandb = wandb_run
        self.flops_per_token, self.tokens_per_step, self.total_steps = flops_per_token, tokens_per_step, total_steps
        self.n_devices = jax.device_count()
        self.peak = peak_flops(jax.devices()[0])
        self.console = console or Console(highlight=False)
        self._since: tuple[int, float] | None = None
        self._clock: tuple[int, float] | None = None  # where throughput timing started (for the summary)
        self.last: dict = {}
        self.dropped = 0
        if self.enabled:
            path = Path(workdir) / METRICS
            try:
                self.dropped, unreadable = drop_rows_after(path, resume_step) if resume_step is not None else (0, 0)
                self.jsonl = open(path, "a")  # noqa: SIM115 (closed in close())
                purge = dict(purge_step=resume_step + 1) if resume_step is not None else {}
                self.tb = SummaryWriter(str(Path(workdir) / TENSORBOARD), **purge)
            except OSError as e:
                if (error := storage_error(e, path, "the metrics file")) is None:
                    raise
                raise error from None
            if unreadable:
                self.console.print(f"note: dropped {unreadable} unreadable line(s) of {path} (a write cut short)",
                                   soft_wrap=True, markup=False, highlight=False)

    def start_clock(self, step: int) -> None:
        """Measure throughput from now, when ``step`` has just finished on the device."""
        self._since = self._clock = (step, time.perf_counter())

    def log(self, step: int, values: dict[str, float]) -> dict:
        """Record ``values`` (loss, grad_norm, lr, skipped, ... as Python numbers) at ``step``; returns the record."""
        now = time.perf_counter()
        tokens_per_s = None
        if self._since is not None and step > self._since[0]:
            tokens_per_s = (step - self._since[0]) * self.tokens_per_step / (now - self._since[1])
        self._since = (step, now)
        memory, peak_memory = device_memory_gib()
        per_device = tokens_per_s / self.n_devices if tokens_per_s is not None else None
        record = dict(step=step, **values, tokens_per_s=tokens_per_s, tokens_per_s_per_device=per_device,
                      mfu=self._mfu(per_device), memory_gib=memory, peak_memory_gib=peak_memory)
        self.last = record
        if self.enabled:
            self._write(record)
        return record

    def _pause(self, seconds: float) -> None:
        """Leave ``seconds`` spent on something else (an evaluation) out of the training throughput."""
        self._since = self._since and (self._since[0], self._since[1] + seconds)
        self._clock = self._clock and (self._clock[0], self._clock[1] + seconds)

    def log_validation(self, step: int, values: dict[str, float]) -> dict:
        """Record a validation (``val_loss``, ``val_ppl``) at ``step``; returns the record. Its ``seconds`` (when
        given) are left out of the training throughput."""
        values = dict(values)
        self._pause(values.pop("seconds", 0.0))
        record = dict(step=step, **values)
        if self.enabled:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            for key, value in values.items():
                self.tb.add_scalar(f"val/{key.removeprefix('val_')}", value, step)
            self.tb.flush()
            self._to_wandb({f"val/{k.removeprefix('val_')}": v for k, v in values.items()}, step)
            self.console.print(f"step {step:>6}/{self.total_steps}  validation loss {values['val_loss']:.4f}  "
                               f"perplexity {values['val_ppl']:.2f}", soft_wrap=True)
        return record

    def log_tasks(self, step: int, values: dict[str, float], documents: int) -> dict:
        """Record a task evaluation at ``step`` (``{"eval/TASK/METRIC": value, "seconds": s}``, ``documents`` per
        task); returns the record. Its seconds are left out of the training throughput."""
        values = dict(values)
        seconds = values.pop("seconds", 0.0)
        self._pause(seconds)
        record = dict(step=step, **values, eval_seconds=seconds)
        if self.enabled:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
            self._to_wandb({**values, "eval/seconds": seconds}, step)
            tasks: dict[str, list[str]] = {}
            for key, value in values.items():
                _, task, metric = key.split("/", 2)
                tasks.setdefault(task, []).append(f"{metric} {value:.4f}")
            shown = "   ".join(f"{task} {' '.join(metrics)}" for task, metrics in tasks.items())
            self.console.print(f"step {step:>6}/{self.total_steps}  tasks: {shown}  ({documents} documents each, "
                               f"{seconds:.1f} s)", soft_wrap=True, markup=False, highlight=False)
        return record

    def throughput(self) -> tuple[float | None, float | None]:
        """Mean ``(tokens/s, MFU)`` from :meth:`start_clock` to the last logged step (None when not measured)."""
        if self._clock is None or self._since is None or self._since[0] <= self._clock[0]:
            return None, None
        tokens_per_s = (self._since[0] - self._clock[0]) * self.tokens_per_step / (self._since[1] - self._clock[1])
        return tokens_per_s, self._mfu(tokens_per_s / self.n_devices)

    def _mfu(self, per_device: float | None) -> float | None:
        return per_device * self.flops_per_token / self.peak if per_device is not None and self.peak else None

    def warn(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"[bold yellow]warning:[/] {message}")

    def _write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        scalars = {f"train/{k}": v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        for key, value in scalars.items():
            self.tb.add_scalar(key, value, record["step"])
        self.tb.flush()
        self._to_wandb(scalars, record["step"])
        fmt = lambda key, spec: "-" if record.get(key) is None else format(record[key], spec)
        self.console.print(
            f"step {record['step']:>6}/{self.total_steps}  loss {fmt('loss', '.4f')}  "
            f"grad_norm {fmt('grad_norm', '.3f')}  lr {fmt('lr', '.2e')}  "
            f"tok/s/dev {fmt('tokens_per_s_per_device', ',.0f')}  mfu {fmt('mfu', '.1%')}  "
            f"peak mem {fmt('peak_memory_gib', '.1f')} GiB  skipped {record.get('skipped', 0)}",
            soft_wrap=True,
        )

    def _to_wandb(self, values: dict[str, float], step: int) -> None:
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
