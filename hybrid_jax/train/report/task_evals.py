"""Downstream tasks during training: the lm-eval tasks of ``train.eval_tasks`` (the bundled task files of
``hybrid_jax/eval/tasks``, checked by the preflight) scored on the live parameters, on the training devices.

The lm-eval model is :class:`hybrid_jax.eval.lm.HybridJaxLM`, built once on the trainer's graphdef: each evaluation
hands it the train state's parameters as they are (nothing copied to the host, nothing reloaded) and scores the
first ``train.eval_tasks_limit`` documents of each task, the same documents every time, zero-shot, in batches of
``micro_batch_size x data shards`` rows split over the data axis like a training micro step. Its scoring functions
compile at the first evaluation (one per length bucket) and are reused. lm-eval's progress bars and INFO logs are
kept off the training console; an evaluation that fails is a warning and training goes on.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from hybrid_jax.data.tokenizer import Tokenizer
from hybrid_jax.train.step import mesh as mesh_lib

QUIET_LOGGERS = ("lm-eval", "lm_eval", "datasets", "evaluate")


@contextlib.contextmanager
def _quiet():
    """lm-eval's and datasets' progress bars (stderr) and INFO / WARNING logs silenced for the block."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def task_metrics(results: dict) -> dict[str, float]:
    """lm-eval's ``{"arc_easy": {"acc,none": 0.26, "acc_stderr,none": ..., "alias": ..., "sample_len": 3}}`` ->
    ``{"eval/arc_easy/acc": 0.26, ...}`` (the metrics, ``NAME,FILTER``, not their standard errors)."""
    return {f"eval/{task}/{key.split(',')[0]}": float(value) for task, metrics in results.items()
            for key, value in metrics.items() if "," in key and "stderr" not in key and isinstance(value, int | float)}


class TaskEvals:
    """``evals(params) -> {"eval/TASK/METRIC": value, ..., "seconds": s}`` for the run of ``config`` on ``mesh``.

    ``graphdef``: the trainer's; ``tokenizer``: the run's; ``data_dir``: the tasks' data folder (the preflight's)."""

    def __init__(self, config: ConfigDict, graphdef: nnx.GraphDef, tokenizer: Tokenizer, mesh: Mesh, data_dir: Path):
        from hybrid_jax.eval.lm import HybridJaxLM

        t = config.train
        self.tasks, self.limit, self.data_dir, self.mesh = t.eval_tasks.split(","), t.eval_tasks_limit, data_dir, mesh
        self.batch = t.micro_batch_size * mesh_lib.batch_shards(mesh)
        self.lm = HybridJaxLM((graphdef, None), tokenizer, batch_size=self.batch, max_length=t.seq_len,
                              sharding=mesh_lib.batch_sharding(mesh))

    def __call__(self, params: dict) -> dict[str, float]:
        """Score the tasks with ``params`` (the train state's, used in place; the first call also compiles)."""
        from hybrid_jax.eval.run import run_tasks

        start = time.perf_counter()
        self.lm.state = params
        try:
            with jax.set_mesh(self.mesh), _quiet():
                out = run_tasks(self.lm, self.tasks, limit=self.limit, batch_size=self.batch, data_dir=self.data_dir)
        finally:
            self.lm.state = None  # the next step donates these buffers: never hold on to them
        return {**task_metrics(out["results"]), "seconds": time.perf_counter() - start}
