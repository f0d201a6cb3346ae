"""Up-front checks of a run config's values, each a one-line :class:`ConfigError` that names the key and says what to
change. They look only at the config (no files, no devices beyond the batch-shard count), so they run before
anything is built or written; the files a run reads are checked by :mod:`hybrid_jax.train.preflight`."""

from __future__ import annotations

import math

import jax.numpy as jnp
from ml_collections import ConfigDict

from hybrid_jax.config import flat_items
from hybrid_jax.kernels.registry import IMPLS
from hybrid_jax.model.plan import REMAT_MODES, sublayer_kinds
from hybrid_jax.train.step.schedule import DECAY_SHAPES, SCHEDULES, decay_steps

DATA_SOURCES = ("mock", "tokens", "megatron")
WANDB_MODES = ("online", "offline")
MAY_BE_ZERO = frozenset({"chunk_size"})  # 0: tuned per GPU and mixer
_SIZE_WORDS = ("size", "dim", "heads", "rank", "layers", "groups", "expand", "vocab")


class ConfigError(ValueError):
    """A run config that cannot train; the message names the keys and the numbers."""


def accumulation_steps(train_cfg: ConfigDict, batch_shards: int) -> int:
    """``global_batch / (micro_batch x batch_shards)``; a ConfigError when it does not divide."""
    g, m = train_cfg.global_batch_size, train_cfg.micro_batch_size
    if g <= 0 or m <= 0:
        raise ConfigError(f"train.global_batch_size={g} and train.micro_batch_size={m} must be positive")
    if g % (m * batch_shards):
        raise ConfigError(
            f"train.global_batch_size={g} must equal micro_batch_size x accumulation x data shards, but it is not "
            f"divisible by micro_batch_size={m} x data shards={batch_shards} = {m * batch_shards}; "
            f"choose a global batch that is a multiple of {m * batch_shards} or another micro_batch_size"
        )
    return g // (m * batch_shards)


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} must be one of {', '.join(allowed)}")


def check_model(model: ConfigDict) -> None:
    """Every size, count and rank of ``model`` a positive integer, the plan and dtypes valid."""
    for key, value in flat_items(model):
        if not any(word in key for word in _SIZE_WORDS) or isinstance(value, bool) or not isinstance(value, int):
            continue
        if value < 0 or (value == 0 and key not in MAY_BE_ZERO):
            raise ConfigError(f"model.{key}={value} must be a positive integer")
    try:
        sublayer_kinds(model)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    if model.pattern and model.num_layers != len(model.pattern):
        raise ConfigError(f"model.num_layers={model.num_layers} has no effect beside model.pattern={model.pattern!r} "
                          f"({len(model.pattern)} sublayers): change the pattern, set num_layers={len(model.pattern)}, "
                          "or set model.pattern='' to plan the layers from num_layers")
    for key in ("dtype", "param_dtype"):
        try:
            jnp.dtype(model[key])
        except TypeError:
            raise ConfigError(f"model.{key}={model[key]!r} is not a dtype (e.g. bfloat16, float32)") from None
    _one_of("model.kernel_impl", model.kernel_impl, IMPLS)
    _one_of("model.remat", model.remat, REMAT_MODES)
    c = model.chunk_size
    if c != 0 and (c < 16 or c & (c - 1)):
        raise ConfigError(f"model.chunk_size={c} must be 0 (tuned per GPU and mixer) or a power of two >= 16")


def _check_train(t: ConfigDict) -> None:
    positive = ("steps", "seq_len", "log_every", "save_every", "keep_checkpoints", "loss_chunk_size",
                "max_skipped_in_a_row", "eval_batches")
    for key in positive:
        if t[key] <= 0:
            raise ConfigError(f"train.{key}={t[key]} must be positive")
    for key in ("eval_every", "warmup_steps", "restore_step"):
        if t[key] < 0:
            raise ConfigError(f"train.{key}={t[key]} must be >= 0")
    for key in ("lr", "min_lr", "weight_decay", "b1", "b2", "eps", "clip_norm"):
        if not math.isfinite(t[key]) or t[key] < 0:
            raise ConfigError(f"train.{key}={t[key]} must be a finite number >= 0")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must not exceed train.lr={t.lr}")
    for key in ("b1", "b2"):
        if not t[key] < 1:
            raise ConfigError(f"train.{key}={t[key]} must be below 1")
    _check_schedule(t)
    _check_run_extras(t)


def _check_schedule(t: ConfigDict) -> None:
    _one_of("train.lr_schedule", t.lr_schedule, SCHEDULES)
    _one_of("train.decay_shape", t.decay_shape, DECAY_SHAPES)
    if not 0 < t.decay_fraction <= 1:
        raise ConfigError(f"train.decay_fraction={t.decay_fraction} must be in (0, 1]: the share of train.steps the "
                          "WSD decay takes")
    if t.lr_schedule != "wsd":
        return
    decay, warmup = decay_steps(t), min(t.warmup_steps, t.steps)
    if decay < 1:
        raise ConfigError(f"train.decay_fraction={t.decay_fraction} x train.steps={t.steps} rounds to no decay step; "
                          "raise train.decay_fraction")
    if warmup + decay > t.steps:
        raise ConfigError(f"train.warmup_steps={warmup} and the WSD decay's {decay} steps (train.decay_fraction="
                          f"{t.decay_fraction} x train.steps={t.steps}) overlap; lower one of them or raise "
                          "train.steps")


def _check_run_extras(t: ConfigDict) -> None:
    """Task evaluations and W&B: their values (their files and packages are the preflight's)."""
    if t.eval_tasks:
        names = t.eval_tasks.split(",")
        if any(not n.strip() or n != n.strip() for n in names):
            raise ConfigError(f"train.eval_tasks={t.eval_tasks!r} must be task names separated by commas, without "
                              "spaces, e.g. arc_easy,piqa")
        for key in ("eval_tasks_every", "eval_tasks_limit"):
            if t[key] <= 0:
                raise ConfigError(f"train.{key}={t[key]} must be positive with train.eval_tasks")
    _one_of("train.wandb_mode", t.wandb_mode, WANDB_MODES)


def _check_context(config: ConfigDict) -> None:
    """``mesh.context`` splits each sequence in equal shards, each at least as long as the short convs' halo (and of
    an even length with MLA, which trades the second halves of the shards)."""
    n, T = config.mesh.get("context", 1), config.train.seq_len
    if n == 1:
        return
    if n < 1 or T % n:
        raise ConfigError(f"mesh.context={n} must be a positive divisor of train.seq_len={T}: each of its devices "
                          "takes an equal part of every sequence")
    kinds = set(sublayer_kinds(config.model))
    halo = max([config.model[kind].conv_size - 1 for kind in ("gdn", "kda", "mamba2") if kind in kinds], default=0)
    if T // n < halo:
        raise ConfigError(f"mesh.context={n} cuts train.seq_len={T} into parts of {T // n} tokens, fewer than the "
                          f"{halo} the short convs read from the part before; use a smaller mesh.context")
    if "mla" in kinds and (T // n) % 2:
        raise ConfigError(f"mesh.context={n} cuts train.seq_len={T} into parts of {T // n} tokens, an odd number: MLA "
                          "balances its causal work over the devices by halves of each part; make seq_len / "
                          "mesh.context even")


def check_config(config: ConfigDict, batch_shards: int) -> int:
    """Check ``config`` for a mesh with ``batch_shards`` batch shards; returns the accumulation steps."""
    check_model(config.model)
    _check_train(config.train)
    _check_context(config)
    d = config.data
    _one_of("data.source", d.source, DATA_SOURCES)
    if d.source == "tokens" and not d.path:
        raise ConfigError("data.source='tokens' needs data.path: the --output directory of hybrid_jax.prepare")
    if d.source == "megatron" and not d.path:
        raise ConfigError("data.source='megatron' needs data.path: a Megatron dataset's path prefix (PREFIX.bin and "
                          "PREFIX.idx) or a blend such as '0.7 data/a 0.3 data/b'")
    if d.source == "mock" and config.model.vocab_size <= 4:
        raise ConfigError(f"mock data needs model.vocab_size > 4, got {config.model.vocab_size}")
    if d.validation_path == "mock" and d.source != "mock":
        raise ConfigError("data.validation_path='mock' is for mock-data runs; give a prepared dataset or a "
                          ".jsonl/.parquet of documents")
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be >= 0")
    return accumulation_steps(config.train, batch_shards)


def clamp_warmup(train_cfg: ConfigDict) -> str | None:
    """A warmup longer than the run becomes the whole run (``warmup_steps = steps``); returns the note to print."""
    if train_cfg.warmup_steps <= train_cfg.steps:
        return None
    note = (f"note: train.warmup_steps={train_cfg.warmup_steps} is longer than train.steps={train_cfg.steps}; "
            f"warming up over all {train_cfg.steps} steps instead")
    train_cfg.warmup_steps = train_cfg.steps
    return note
