"""The training run: config -> mesh -> state (fresh or restored) -> steps -> metrics and checkpoints."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.data import make_train_iterator
from hybrid_jax.flops import flops_per_token
from hybrid_jax.model import HybridLM, count_params, layer_plan
from hybrid_jax.train import mesh as mesh_lib
from hybrid_jax.train.evaluate import Evaluator
from hybrid_jax.train.inputs import check_inputs
from hybrid_jax.train.interrupt import Interrupted, StopRequests
from hybrid_jax.train.metrics import MetricsLogger
from hybrid_jax.train.optim import make_optimizer
from hybrid_jax.train.progress import TrainProgress
from hybrid_jax.train.resume import open_run, resume
from hybrid_jax.train.step import init_state, make_train_step
from hybrid_jax.train.validate import ConfigError, clamp_warmup, validate


class TooManySkippedSteps(RuntimeError):
    """``train.max_skipped_in_a_row`` consecutive steps had a non-finite loss, gradient or update."""


def abstract_like(state: dict, shardings: dict) -> dict:
    """``ShapeDtypeStruct`` leaves with the given shardings: the restore target of ``state``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def train(config: ConfigDict, *, stop_after: int | None = None, log=print) -> dict:
    """Train ``config`` in ``config.train.workdir``, resuming from its newest complete checkpoint.

    ``stop_after``: stop (and checkpoint) once this step is done, e.g. to split a run across jobs; the
    schedule still follows ``train.steps``. Returns the last logged metrics record.
    """
    t = config.train
    try:
        mesh = mesh_lib.make_mesh(config.mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    accum = validate(config, mesh_lib.batch_shards(mesh))
    notes = [clamp_warmup(t), *(inputs := check_inputs(config, mesh_lib.batch_shards(mesh))).notes]  # files
    workdir = Path(t.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log(config)
    for note in filter(None, notes):
        log(note)
    log(f"model {config.model.name}: {count_params(config.model) / 1e6:.2f}M parameters, plan "
        f"{layer_plan(config.model)}; mesh {dict(mesh.shape)}, accumulation {accum}, workdir {workdir}")

    tx = make_optimizer(t)
    graphdef, state, shardings = init_state(
        lambda: HybridLM(config.model, rngs=nnx.Rngs(t.seed)), tx, mesh, zero1=t.zero1, seed=t.seed
    )
    data_iter = make_train_iterator(config, process_index=jax.process_index(), process_count=jax.process_count())
    ckpt, lock = open_run(workdir, t, log)  # one run per workdir (train/lock.py), then its checkpoints
    try:  # the newest checkpoint that passes its checks, or train.restore_step; the config history (train/resume.py)
        state = resume(ckpt, config, abstract_like(state, shardings), data_iter, log) or state
    except BaseException:
        ckpt.close()
        lock.release()
        raise

    step_fn = make_train_step(graphdef, tx, t, mesh, shardings, accum=accum)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    progress = TrainProgress(t.steps)
    logger = MetricsLogger(workdir, flops_per_token=flops_per_token(config.model, t.seq_len),
                           tokens_per_step=t.global_batch_size * t.seq_len, total_steps=t.steps,
                           resume_step=int(state["step"]), console=progress.console)
    evaluator = None if inputs.windows is None else Evaluator(graphdef, inputs.windows, t, mesh, shardings["params"])
    first, last = int(state["step"]) + 1, min(t.steps, stop_after or t.steps)
    record: dict = {}
    if first > last:
        log(f"nothing to do: the checkpoint is at step {first - 1} and the run ends at step {last}")
    previous = None  # the last step's metrics, read one step late so the host never stalls the device
    stop, stopping = StopRequests(say=progress.print), False  # Ctrl-C / SIGTERM: finish the step, save, stop
    try:
        with progress, stop:
            for step in range(first, last + 1):
                batch = jax.make_array_from_process_local_data(batch_sharding, next(data_iter))
                if step == first:
                    with progress.compiling():
                        state, metrics = step_fn(state, batch)
                        jax.block_until_ready(metrics)
                    logger.start_clock(step)
                    progress.start(step)
                else:
                    state, metrics = step_fn(state, batch)
                if previous is not None:
                    _check_skipped(*previous, t.max_skipped_in_a_row, logger)
                previous = (step, metrics)
                logged = step % t.log_every == 0 or step == last
                stopping = stop.should_stop(step, log_point=logged, manager=ckpt.manager)
                if logged or stopping:  # the step a run stops at is logged too
                    values = {k: v.item() for k, v in jax.device_get(metrics).items() if k != "finite"}
                    record = logger.log(step, values)
                if ckpt.save(step, state, data_iter, force=step == last or stopping):
                    progress.saving(step, ckpt.manager.directory)
                if evaluator is not None and (step % t.eval_every == 0 or step == last or stopping):
                    logger.log_validation(step, evaluator(state["params"], progress))
                progress.advance(step, record if logged else None)
                progress.saved(ckpt.manager.is_saving_in_progress())
                if stopping:
                    break
            if previous is not None:
                _check_skipped(*previous, t.max_skipped_in_a_row, logger)
    finally:
        try:
            ckpt.wait()
        finally:
            ckpt.close()
            lock.release()
            logger.close()
        data_iter.close()
    progress.saved(False)
    if first <= last:
        tokens_per_s, mfu = logger.throughput()
        progress.summary(first=first, last=step, tokens_per_step=t.global_batch_size * t.seq_len,
                         tokens_per_s=tokens_per_s, mfu=mfu,
                         skipped=int(state["skipped"]), workdir=workdir, interrupted=stopping)
    if stopping:
        raise Interrupted(step, stop.signum, str(workdir))
    return record


def _check_skipped(step: int, metrics: dict, limit: int, logger: MetricsLogger) -> None:
    if bool(metrics["finite"]):
        return
    in_a_row = int(metrics["skipped_in_a_row"])
    logger.warn(f"step {step}: non-finite loss, gradient or update, update skipped ({in_a_row} in a row, "
                f"{int(metrics['skipped'])} in total)")
    if in_a_row >= limit:
        raise TooManySkippedSteps(
            f"stopping: {in_a_row} steps in a row had a non-finite loss, gradient or update "
            f"(train.max_skipped_in_a_row={limit}); lower train.lr, check the data, or restart from an earlier "
            "checkpoint with --config.train.restore_step=STEP"
        )
