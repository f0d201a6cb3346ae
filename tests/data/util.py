"""Helpers of the data tests."""

from ml_collections import ConfigDict

from hybrid_jax.config import base_config


def small_config(**overrides) -> ConfigDict:
    """``base_config()`` with a tiny vocab/batch/sequence; ``overrides`` as ``{"section.key": value}``."""
    c = base_config()
    c.model.vocab_size = 64
    c.train.update(dict(seq_len=16, global_batch_size=4, seed=7))
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c
