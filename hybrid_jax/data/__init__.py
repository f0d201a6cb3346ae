"""Data: tokenizers, ``prepare`` (raw text -> token shards), opening a prepared dataset and the Grain stream of
typed batches."""

from hybrid_jax.data.pipeline import Batch, DataStream, resume_position
from hybrid_jax.data.shards import PreparedDataset, open_dataset
from hybrid_jax.data.tokenizer import check_vocab, load_tokenizer

__all__ = ["Batch", "DataStream", "PreparedDataset", "check_vocab", "load_tokenizer", "open_dataset",
           "resume_position"]
