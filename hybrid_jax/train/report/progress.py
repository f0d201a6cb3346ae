"""The trainer's console: "compiling ..." with its duration, a live bar, checkpoint lines, a final summary.

On a terminal a rich bar shows step / total, elapsed, ETA, tokens/s and the last logged loss, and every other line
(metrics, checkpoints, validation, warnings) prints above it. Elsewhere (a log file, SLURM's output, a pipe)
there is no bar, only the same plain lines, so logs stay grep-able. Only process 0 prints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class TrainProgress:
    """Owns the console of a run; use as a context manager around the steps."""

    def __init__(self, total_steps: int, *, console: Console | None = None):
        self.enabled = jax.process_index() == 0
        self.console = console or Console(highlight=False, quiet=not self.enabled)
        self.total = total_steps
        self.t0 = time.perf_counter()
        self._bar: Progress | None = None
        self._task = None
        self._pending: list[tuple[int, Path]] = []

    def print(self, *lines: object) -> None:
        """Plain lines (above the bar when there is one)."""
        for line in lines:
            self.console.print(line, soft_wrap=True, highlight=False, markup=False)

    @contextmanager
    def compiling(self, what: str = "the train step") -> Iterator[None]:
        """``compiling WHAT ...`` then ``compiled WHAT in N s`` around the block (a spinner on a terminal)."""
        start = time.perf_counter()
        if self.console.is_terminal and self._bar is None:
            with self.console.status(f"compiling {what} ..."):
                yield
        else:
            self.print(f"compiling {what} ...")
            yield
        self.print(f"compiled {what} in {time.perf_counter() - start:.1f} s")

    def start(self, first_step: int) -> None:
        """Show the bar from ``first_step - 1`` done (a resumed run starts part way)."""
        if not (self.enabled and self.console.is_terminal):
            return
        columns = (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TextColumn("eta"),
                   TimeRemainingColumn(), TextColumn("{task.fields[rate]}  loss {task.fields[loss]}"))
        self._bar = Progress(*columns, console=self.console, transient=True)
        self._task = self._bar.add_task("train", total=self.total, completed=first_step - 1, rate="- tok/s",
                                        loss="-")
        self._bar.start()

    def advance(self, step: int, record: dict | None = None) -> None:
        """``step`` is done; ``record``: the metrics just logged (their tokens/s and loss go on the bar)."""
        if self._bar is None:
            return
        fields = {}
        if record:
            if record.get("tokens_per_s") is not None:
                fields["rate"] = f"{record['tokens_per_s']:,.0f} tok/s"
            if record.get("loss") is not None:
                fields["loss"] = f"{record['loss']:.4f}"
        self._bar.update(self._task, completed=step, **fields)

    def saving(self, step: int, directory: Path) -> None:
        """An async checkpoint save of ``step`` into ``directory`` started; :meth:`saved` prints it once done."""
        self._pending.append((step, directory))

    def saved(self, in_progress: bool) -> None:
        """Print ``checkpoint saved: step N (PATH)`` for the saves started so far, unless one is ``in_progress``."""
        if in_progress:
            return
        for step, directory in self._pending:
            self.print(f"checkpoint saved: step {step} ({directory / str(step)})")
        self._pending.clear()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self, *, first: int, last: int, tokens_per_step: int, tokens_per_s: float | None,
                mfu: float | None, skipped: int, workdir: Path, interrupted: bool = False) -> None:
        """The end-of-run lines: steps, tokens, wall time, mean tokens/s and MFU, skips, where things are."""
        steps = max(last - first + 1, 0)
        rate = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s else "- tokens/s"
        mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "MFU - (no peak FLOP/s for this device)"
        head = "stopped" if interrupted else "done"
        self.print(
            f"{head}: steps {first}-{last} of {self.total} ({steps} this run, {steps * tokens_per_step:,} tokens) in "
            f"{_duration(time.perf_counter() - self.t0)}; mean {rate}, {mfu_text}; {skipped} skipped steps",
            f"checkpoints: {workdir.resolve() / 'checkpoints'}; metrics: {workdir.resolve() / 'metrics.jsonl'}; "
            f"TensorBoard: tensorboard --logdir {workdir.resolve() / 'tensorboard'}",
        )
