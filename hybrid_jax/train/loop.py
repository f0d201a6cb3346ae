"""The training run: preflight -> trainer -> state (fresh, restored or branched) -> steps -> metrics, evaluations and
checkpoints."""

from __future__ import annotations

from pathlib import Path

import jax
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import Checkpointer, carry_out
from hybrid_jax.data.pipeline import DataStream, resume_position
from hybrid_jax.flops import flops_per_token
from hybrid_jax.model import count_params, layer_plan
from hybrid_jax.train.preflight import preflight
from hybrid_jax.train.report.heldout_loss import HeldoutLoss
from hybrid_jax.train.report.metrics import MetricsLogger, start_wandb
from hybrid_jax.train.report.progress import TrainProgress
from hybrid_jax.train.report.task_evals import TaskEvals
from hybrid_jax.train.stops import Interrupted, StopRequests, check_skipped
from hybrid_jax.train.trainer import build_trainer


def train(config: ConfigDict, *, stop_after: int | None = None, force: bool = False, log=print) -> dict:
    """Train ``config`` in ``config.train.workdir``, resuming from its newest usable checkpoint.

    ``stop_after``: stop (and checkpoint) once this step is done, e.g. to split a run across jobs; the
    schedule still follows ``train.steps``. ``force``: train even when the memory estimate says it cannot fit.
    Returns the last logged metrics record.
    """
    t = config.train
    checked = preflight(config, force=force)  # every input read once; the workdir's lock held from here
    workdir = Path(t.workdir)
    ckpt = stream = None
    try:
        log(config)
        for note in checked.notes:
            log(note)
        trainer = build_trainer(config)
        log(f"model {config.model.name}: {count_params(config.model) / 1e6:.2f}M parameters, plan "
            f"{layer_plan(config.model)}; mesh {dict(trainer.mesh.shape)}, accumulation {trainer.accum}, workdir "
            f"{workdir}")
        ckpt = Checkpointer(workdir, config)
        restored = carry_out(checked.plan, ckpt, config, trainer.abstract_state, log)
        state, position = (trainer.state, 0) if restored is None else (restored[0], resume_position(restored[1],
                                                                                                   config, log))
        stream = DataStream(config, checked.dataset, position=position, process_index=jax.process_index(),
                            process_count=jax.process_count())
        return _run(config, trainer, state, stream, ckpt, checked, workdir, stop_after, log)
    finally:
        try:
            if ckpt is not None:
                try:
                    ckpt.wait()
                finally:
                    ckpt.close()
        finally:
            checked.lock.release()
            if stream is not None:
                stream.close()


def _run(config, trainer, state, stream, ckpt, checked, workdir, stop_after, log) -> dict:
    t = config.train
    progress = TrainProgress(t.steps)
    logger = MetricsLogger(workdir, flops_per_token=flops_per_token(config.model, t.seq_len),
                           tokens_per_step=t.global_batch_size * t.seq_len, total_steps=t.steps,
                           resume_step=int(state["step"]), console=progress.console, wandb_run=start_wandb(config))
    heldout = checked.heldout
    evaluator = None if heldout is None else HeldoutLoss(trainer.graphdef, heldout, t.loss_chunk_size, trainer.mesh,
                                                         trainer.shardings["params"])
    tasks = None if checked.tasks_data is None else TaskEvals(config, trainer.graphdef, checked.tokenizer.load(),
                                                              trainer.mesh, checked.tasks_data)
    first, last = int(state["step"]) + 1, min(t.steps, stop_after or t.steps)
    record: dict = {}
    if first > last:
        log(f"nothing to do: the checkpoint is at step {first - 1} and the run ends at step {last}")
    previous = None  # the last step's metrics, read one step late so the host never stalls the device
    stop, stopping, step = StopRequests(say=progress.print), False, first - 1
    try:
        with progress, stop:
            for step in range(first, last + 1):
                batch = trainer.put(next(stream))
                if step == first:
                    with progress.compiling():
                        state, metrics = trainer.step(state, batch)
                        jax.block_until_ready(metrics)
                    logger.start_clock(step)
                    progress.start(step)
                else:
                    state, metrics = trainer.step(state, batch)
                if previous is not None:
                    check_skipped(*previous, t.max_skipped_in_a_row, logger.warn)
                previous = (step, metrics)
                logged = step % t.log_every == 0 or step == last
                stopping = stop.should_stop(step, log_point=logged, manager=ckpt.manager)
                if logged or stopping:  # the step a run stops at is logged too
                    values = {k: v.item() for k, v in jax.device_get(metrics).items() if k != "finite"}
                    record = logger.log(step, {**values, **stream.source_tokens()})
                if ckpt.save(step, state, stream.saved(), force=step == last or stopping):
                    progress.saving(step, ckpt.directory)
                if evaluator is not None and (step % t.eval_every == 0 or step == last or stopping):
                    logger.log_validation(step, evaluator(state["params"], progress))
                if tasks is not None and (step % t.eval_tasks_every == 0 or step == last) and not stopping:
                    _score_tasks(tasks, state["params"], step, logger, t.eval_tasks_limit)
                progress.advance(step, record if logged else None)
                progress.saved(ckpt.manager.is_saving_in_progress())
                if stopping:
                    break
            if previous is not None:
                check_skipped(*previous, t.max_skipped_in_a_row, logger.warn)
        ckpt.wait()
    finally:
        logger.close()
    progress.saved(False)
    if first <= last:
        tokens_per_s, mfu = logger.throughput()
        progress.summary(first=first, last=step, tokens_per_step=t.global_batch_size * t.seq_len,
                         tokens_per_s=tokens_per_s, mfu=mfu, skipped=int(state["skipped"]), workdir=workdir,
                         interrupted=stopping)
    if stopping:
        raise Interrupted(step, stop.signum, str(workdir))
    return record


def _score_tasks(tasks: TaskEvals, params: dict, step: int, logger: MetricsLogger, documents: int) -> None:
    """One task evaluation at ``step``, logged; a failure is a warning and the run goes on."""
    try:
        values = tasks(params)
    except Exception as e:  # noqa: BLE001 - an evaluation never stops the training
        first = (str(e).strip().splitlines() or [""])[0][:200]
        logger.warn(f"step {step}: the task evaluation failed ({type(e).__name__}: {first}); training goes on")
        return
    logger.log_tasks(step, values, documents)
