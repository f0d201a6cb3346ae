"""Data: tokenizers, ``prepare`` (raw text -> token shards), the token datasets (ours and Megatron's, behind one
interface), weighted blends of them, and the Grain stream of typed batches."""

from hybrid_jax.data.blend import Blend, open_blend
from hybrid_jax.data.pipeline import Batch, DataStream, resume_position
from hybrid_jax.data.shards import PreparedDataset, open_dataset
from hybrid_jax.data.source import DatasetError, TokenSource, TokenWindows, open_source
from hybrid_jax.data.tokenizer import check_vocab, load_tokenizer

__all__ = ["Batch", "Blend", "DataStream", "DatasetError", "PreparedDataset", "TokenSource", "TokenWindows",
           "check_vocab", "load_tokenizer", "open_blend", "open_dataset", "open_source", "resume_position"]
