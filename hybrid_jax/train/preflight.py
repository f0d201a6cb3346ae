"""Everything a run reads, read once and checked before anything is built: the config's values, the model's shapes,
the training data (each dataset of ``data.path``: a manifest and its shard files, or a Megatron ``.idx`` and its
``.bin``), the tokenizer, the held-out data, the task evaluations' files and packages (``train.eval_tasks``,
``train.wandb_project``), the kernels' tuning file, then, under the workdir's lock, the checkpoint to resume (or
branch) from (its checksums, shapes and config).

Every problem is one line (:class:`~hybrid_jax.train.config_checks.ConfigError` or one of
``hybrid_jax.checkpoints.RUN_ERRORS``) and a refusal changes nothing on disk: a workdir this run created is removed
again, the lock released. What passes comes back as a :class:`Preflight` for the loop: the opened dataset, the run's
tokenizer, the held-out batches, the task data folder, the lock it holds, the resume plan and the notes to print.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import ResumePlan, WorkdirLock, plan_branch, plan_resume
from hybrid_jax.checkpoints.storage import check_writable
from hybrid_jax.data.blend import Blend, open_blend
from hybrid_jax.data.heldout import heldout_windows
from hybrid_jax.data.pipeline import Batch
from hybrid_jax.data.run_tokenizer import NoTokenizer, RunTokenizer, tokenizer_from_manifest
from hybrid_jax.data.source import DatasetError, TokenSource
from hybrid_jax.data.tokenizer import check_vocab, resolve_path
from hybrid_jax.model import HybridLM, layer_plan
from hybrid_jax.train.config_checks import ConfigError, check_config, clamp_warmup
from hybrid_jax.train.step import mesh as mesh_lib
from hybrid_jax.train.step.schedule import continuation_note


@dataclasses.dataclass
class Preflight:
    """What the checks opened: ``dataset`` (the datasets of ``data.path``, a blend of one or more; None for mock
    data), ``tokenizer`` (None without one), ``heldout``
    (``[batches, batch, seq_len + 1]`` validation windows, or None), the held ``lock``, the resume ``plan``, the
    ``notes`` to print and ``tasks_data`` (the data folder of ``train.eval_tasks``, or None)."""

    notes: list[str]
    dataset: Blend | None
    tokenizer: RunTokenizer | None
    heldout: Batch | None
    lock: WorkdirLock
    plan: ResumePlan
    tasks_data: Path | None = None


def abstract_params(model_cfg: ConfigDict) -> dict:
    """The model's parameter shapes (``ShapeDtypeStruct``; nothing allocated); ConfigError for dims that do not fit
    together."""
    try:
        _, params = nnx.split(nnx.eval_shape(lambda: HybridLM(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
    except ValueError as e:
        raise ConfigError(f"model: {str(e).splitlines()[0]}") from None
    return nnx.to_pure_dict(params)


def preflight(config: ConfigDict, n_devices: int | None = None, *, force: bool = False) -> Preflight:
    """Check and open every input of ``config`` (module docstring); may fill ``config.data.tokenizer`` and clamp the
    warmup. ``n_devices``: the devices the run uses (default: all of every process); ``force``: train even when the
    memory estimate says the step cannot fit."""
    try:
        data, fsdp, context = mesh_lib.mesh_shape(config.mesh, jax.device_count() if n_devices is None else n_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    batch_shards = data * fsdp
    check_config(config, batch_shards)
    notes = [clamp_warmup(config.train)]
    params = abstract_params(config.model)
    notes.append(_check_memory(config, params, (data, fsdp, context), force))
    dataset, tokenizer, data_notes = _open_data(config)
    notes += data_notes
    heldout = None
    if config.data.validation_path and config.train.eval_every:
        heldout, note = _heldout(config, batch_shards, tokenizer)
        notes.append(note)
    tasks_data = None
    if config.train.eval_tasks:
        tasks_data, note = _task_evals(config, tokenizer)
        notes.append(note)
    if config.train.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb_project={config.train.wandb_project} needs wandb: pip install wandb (or "
                          "leave train.wandb_project empty)")
    notes.append(_tuning(config))
    lock, plan = _lock_and_plan(config, params, notes)
    return Preflight([n for n in notes if n], dataset, tokenizer, heldout, lock, plan, tasks_data)


# bytes per parameter: float32 weights, gradients and the two AdamW moments; activations kept for the backward per
# token, sublayer and hidden channel, by remat mode (a lower bound: the estimate must never refuse a step that fits;
# "dots": the 3B at 8192 on an H200 peaked at 57.4 / 68.7 / 95.6 GiB at micro batch 1 / 2 / 4, 5 keeps under all three)
STATE_BYTES = 16
ACTIVATION_BYTES = {"none": 12, "mixer": 8, "full": 2, "dots": 5}


def device_memory_bytes() -> int | None:
    """What one local device can hold: the accelerator's limit, or on CPU the host's available memory shared by the
    local CPU devices (None when unknown)."""
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit or device.platform != "cpu":
        return limit
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return None
    return int(meminfo["MemAvailable"].split()[0]) * 1024 // jax.local_device_count()


def _check_memory(config: ConfigDict, params: dict, mesh: tuple[int, int, int], force: bool) -> str | None:
    """Refuse (unless ``force``) a step whose estimated memory per device exceeds what the device has; ``mesh``:
    ``(data, fsdp, context)`` sizes (ZeRO-1 splits the moments over all three, ``context`` the sequence)."""
    data, fsdp, context = mesh
    available = device_memory_bytes()
    if available is None:
        return None
    m, t = config.model, config.train
    n = sum(x.size for x in jax.tree.leaves(params))
    moments = 8 * n / (data * fsdp * context if t.zero1 else fsdp)
    state = (STATE_BYTES - 8) * n / fsdp + moments
    tokens = t.micro_batch_size * t.seq_len // context
    activations = tokens * len(layer_plan(m)) * m.hidden_size * ACTIVATION_BYTES[m.remat]
    need = state + activations
    if need <= available:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    what = (f"the step of {m.name or 'this model'} ({n / 1e9:.2f}B parameters) at micro batch {t.micro_batch_size} x "
            f"{t.seq_len} needs at least {gib(need)} per device (weights, gradients and AdamW moments {gib(state)}, "
            f"activations {gib(activations)}) but a {jax.local_devices()[0].platform} device here has {gib(available)}")
    if force:
        return f"warning: {what}; training anyway (--force)"
    raise ConfigError(f"{what}: lower train.micro_batch_size, set model.remat=full, split over more devices "
                      "(mesh.fsdp), or pass --force to try anyway")


def _open_data(config: ConfigDict) -> tuple[Blend | None, RunTokenizer | None, list[str]]:
    """The training data (each dataset of ``data.path`` opened once) and the run's tokenizer (hashed once); fills
    ``data.tokenizer`` from a prepared dataset's manifest."""
    d, t = config.data, config.train
    tokenizer = None
    if d.tokenizer:
        try:
            tokenizer = RunTokenizer.of(str(resolve_path(d.tokenizer)))
        except FileNotFoundError as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
    if d.source == "mock":
        return None, tokenizer, [] if tokenizer else ["data: mock (a random Markov chain); the run has no tokenizer"]
    try:
        data = open_blend(d.path, d.source)
        for source in data.sources:
            _check_ids(config, source)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.path: {e}") from None
    windows = min(s.num_tokens // (t.seq_len + 1) for s in data.sources)
    if windows < t.global_batch_size:
        small = min(data.sources, key=lambda s: s.num_tokens)
        raise ConfigError(f"data.path={small.path} holds {small.num_tokens:,} tokens: {windows} windows of "
                          f"train.seq_len + 1 = {t.seq_len + 1}, fewer than one batch (train.global_batch_size="
                          f"{t.global_batch_size}); prepare more documents or lower the batch or seq_len")
    notes = data.describe()
    prepared = [s for s in data.sources if s.tokenizer is not None]
    if tokenizer is not None:
        for source in prepared:
            recorded = source.tokenizer
            if tokenizer.sha256 != recorded.get("sha256"):
                raise ConfigError(f"data.tokenizer={d.tokenizer} is not the tokenizer {source.path} was prepared "
                                  f"with ({recorded.get('path')}, sha256 {str(recorded.get('sha256'))[:12]}...)")
        return data, tokenizer, notes + [f"tokenizer: {d.tokenizer}"]
    if not prepared:
        return data, None, notes + ["warning: a Megatron dataset records no tokenizer and data.tokenizer is empty: "
                                    "the run records none (set data.tokenizer for generate, eval and export)"]
    if len({s.tokenizer.get("sha256") for s in prepared}) > 1:
        raise ConfigError(f"data.path: {prepared[0].path} and {prepared[1].path} were prepared with different "
                          "tokenizers; blend datasets of one tokenizer")
    try:
        tokenizer = tokenizer_from_manifest(prepared[0].manifest, prepared[0].path)
    except NoTokenizer as e:
        return data, None, notes + [f"warning: {e}; until then the run records no tokenizer"]
    d.tokenizer = tokenizer.path
    return data, tokenizer, notes + [f"tokenizer: {d.tokenizer} (from its manifest)"]


ID_SAMPLE = 1 << 20  # tokens of a dataset without a recorded vocabulary read at the start for ids >= vocab_size


def _check_ids(config: ConfigDict, source: TokenSource) -> None:
    """A recorded vocabulary must fit ``model.vocab_size``; without one (Megatron's), the first :data:`ID_SAMPLE`
    tokens are checked (every window is checked again as it is read)."""
    if source.vocab_size is not None:
        check_vocab(config.model.vocab_size, source.vocab_size, what=f"the tokenizer of {source.path}")
        return
    first = source.token_files()[0]
    sample = np.memmap(first.path, dtype=first.dtype, mode="r", shape=(min(first.num_tokens, ID_SAMPLE),))
    if sample.size and (int(sample.max()) >= config.model.vocab_size or int(sample.min()) < 0):
        bad = int(sample.max()) if int(sample.max()) >= config.model.vocab_size else int(sample.min())
        raise DatasetError(f"{source.path} holds token id {bad}, not in [0, model.vocab_size={config.model.vocab_size})"
                           f"; {source.id_remedy}")


def _heldout(config: ConfigDict, batch_shards: int, tokenizer: RunTokenizer | None) -> tuple[Batch, str]:
    """``[batches, batch, seq_len + 1]`` validation windows and a line describing them."""
    t, path = config.train, config.data.validation_path
    batch = t.micro_batch_size * batch_shards
    try:
        windows = heldout_windows(config, t.eval_batches * batch, tokenizer)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(str(e)) from None
    batches = len(windows.tokens) // batch
    if batches == 0:
        raise ConfigError(f"data.validation_path={path} gives {len(windows.tokens)} windows of {t.seq_len + 1} "
                          f"tokens, fewer than one validation batch (micro_batch_size x data shards = {batch}); use "
                          "more documents or a smaller train.micro_batch_size")
    note = (f"validation: {batches} batches x {batch} windows x {t.seq_len} tokens of {path}"
            + (f" (only {batches} of train.eval_batches={t.eval_batches} fit in it)" if batches < t.eval_batches
               else "") + f", every {t.eval_every} steps and at the end")
    shaped = Batch(*(None if x is None else x[: batches * batch].reshape(batches, batch, -1) for x in windows))
    return shaped, note


def _task_evals(config: ConfigDict, tokenizer: RunTokenizer | None) -> tuple[Path, str]:
    """The data folder of ``train.eval_tasks`` (every task bundled, every file it reads there, lm-eval installed, a
    tokenizer the model's vocabulary covers) and a line describing the evaluations."""
    t = config.train
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"train.eval_tasks={t.eval_tasks} needs lm-eval: pip install -e '.[eval]' (or leave "
                          "train.eval_tasks empty)")
    if tokenizer is None:
        raise ConfigError(f"train.eval_tasks={t.eval_tasks} needs the run's tokenizer to read the tasks' text: set "
                          "data.tokenizer (this run has none)")
    from hybrid_jax.eval.local_tasks import check_tasks

    try:
        folder = check_tasks(t.eval_tasks.split(","), t.eval_tasks_data or None)
        check_vocab(config.model.vocab_size, tokenizer.load().vocab_size, what=f"the tokenizer {tokenizer.path}")
    except ValueError as e:
        raise ConfigError(f"train.eval_tasks={t.eval_tasks}: {e}") from None
    return folder, (f"task evaluations: {t.eval_tasks.replace(',', ', ')} (the first {t.eval_tasks_limit} documents "
                    f"of each, from {folder}) every {t.eval_tasks_every} steps and at the end")


def _tuning(config: ConfigDict) -> str:
    from hybrid_jax.kernels import tuning_file

    try:
        return f"kernel launch configs: {tuning_file.use(config.model.tuning)}"
    except tuning_file.TuningFileError as e:
        raise ConfigError(f"model.tuning: {e}") from None


def _lock_and_plan(config: ConfigDict, params: dict, notes: list[str]) -> tuple[WorkdirLock, ResumePlan]:
    """Create the workdir, take its lock (process 0), plan the resume (or the branch of a fresh workdir from
    ``train.branch_from``) and say what the schedule does where the run continues; on a refusal undo both."""
    workdir = Path(config.train.workdir)
    created = not workdir.exists()
    lock = WorkdirLock(workdir)
    try:
        if jax.process_index() == 0:
            check_writable(workdir, "workdir")
            lock.acquire(notes.append)
        plan = plan_resume(workdir.resolve(), config, params)
        if config.train.branch_from and plan.step is None:
            plan = plan_branch(workdir.resolve(), config, params)
        elif config.train.branch_from:
            notes.append(f"note: train.branch_from={config.train.branch_from} is not used: {workdir} holds "
                         f"checkpoints of its own (resuming from its step {plan.step})")
        if plan.step is not None:
            notes.append(continuation_note(config.train, plan.changes, plan.step))
        return lock, plan
    except BaseException:
        lock.release()
        if created and jax.process_index() == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
