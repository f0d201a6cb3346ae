"""Data: tokenizers, ``prepare`` (raw text -> token shards) and the Grain training pipeline."""

from hybrid_jax.data.pipeline import make_train_iterator
from hybrid_jax.data.tokenizer import check_vocab, load_tokenizer

__all__ = ["check_vocab", "load_tokenizer", "make_train_iterator"]
