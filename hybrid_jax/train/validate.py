"""Up-front checks of a run config, with messages that say what to change."""

from __future__ import annotations

import jax.numpy as jnp
from ml_collections import ConfigDict

from hybrid_jax.model.plan import sublayer_kinds
from hybrid_jax.train.model_sizes import check_model_sizes


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
    c = config.model.chunk_size
    if c != 0 and (c < 16 or c & (c - 1)):
        raise ConfigError(f"model.chunk_size={c} must be 0 (tuned per GPU and mixer) or a power of two >= 16")
    t = config.train
    positive = ("steps", "seq_len", "log_every", "save_every", "keep_checkpoints", "loss_chunk_size",
                "max_skipped_in_a_row")
    for key in positive:
        if t[key] <= 0:
            raise ConfigError(f"train.{key}={t[key]} must be positive")
    if not 0 <= t.warmup_steps <= t.steps:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be in [0, train.steps={t.steps}]")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must be in [0, train.lr={t.lr}]")
    if config.data.source not in ("mock", "tokens"):
        raise ConfigError(f"data.source={config.data.source!r}: use 'mock' or 'tokens' (with data.path)")
    return accumulation_steps(t, batch_shards)
