"""Up-front checks of a run config's values, with messages that say what to change.

Everything here looks only at the config (no files, no devices beyond the batch-shard count), so it runs before
the model is built and before the workdir is created. The files a run reads are checked by
:mod:`hybrid_jax.train.inputs`.
"""

from __future__ import annotations

import jax.numpy as jnp
from ml_collections import ConfigDict

from hybrid_jax.model.plan import sublayer_kinds
from hybrid_jax.train.model_sizes import check_model_sizes

KERNEL_IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "naive")
REMAT_MODES = ("none", "mixer", "full")
DATA_SOURCES = ("mock", "tokens")


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


def validate(config: ConfigDict, batch_shards: int) -> int:
    """Check ``config`` for a mesh with ``batch_shards`` batch shards; returns the accumulation steps."""
    check_model_sizes(config.model, ConfigError)
    try:
        sublayer_kinds(config.model)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    for key in ("dtype", "param_dtype"):
        try:
            jnp.dtype(config.model[key])
        except TypeError:
            raise ConfigError(f"model.{key}={config.model[key]!r} is not a dtype (e.g. bfloat16, float32)") from None
    _one_of("model.kernel_impl", config.model.kernel_impl, KERNEL_IMPLS)
    _one_of("model.remat", config.model.remat, REMAT_MODES)
    c = config.model.chunk_size
    if c != 0 and (c < 16 or c & (c - 1)):
        raise ConfigError(f"model.chunk_size={c} must be 0 (tuned per GPU and mixer) or a power of two >= 16")
    if config.model.vocab_size <= 0 or config.model.hidden_size <= 0:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} and model.hidden_size="
                          f"{config.model.hidden_size} must be positive")
    t = config.train
    positive = ("steps", "seq_len", "log_every", "save_every", "keep_checkpoints", "loss_chunk_size",
                "max_skipped_in_a_row", "eval_batches")
    for key in positive:
        if t[key] <= 0:
            raise ConfigError(f"train.{key}={t[key]} must be positive")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every} must be >= 0 (0: no validation)")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must be in [0, train.lr={t.lr}]")
    _one_of("data.source", config.data.source, DATA_SOURCES)
    if config.data.source == "tokens" and not config.data.path:
        raise ConfigError("data.source='tokens' needs data.path: the --output directory of hybrid_jax.prepare")
    if config.data.source == "mock" and config.model.vocab_size <= 4:
        raise ConfigError(f"mock data needs model.vocab_size > 4, got {config.model.vocab_size}")
    if config.data.validation_path == "mock" and config.data.source != "mock":
        raise ConfigError("data.validation_path='mock' is for mock-data runs; give a prepared dataset or a "
                          ".jsonl/.parquet of documents")
    if config.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={config.data.num_workers} must be >= 0")
    return accumulation_steps(t, batch_shards)


def clamp_warmup(train_cfg: ConfigDict) -> str | None:
    """A warmup longer than the run becomes the whole run (``warmup_steps = steps``); returns the note to print."""
    if train_cfg.warmup_steps <= train_cfg.steps:
        return None
    note = (f"note: train.warmup_steps={train_cfg.warmup_steps} is longer than train.steps={train_cfg.steps}; "
            f"warming up over all {train_cfg.steps} steps instead")
    train_cfg.warmup_steps = train_cfg.steps
    return note
