"""Helpers of the data tests."""

from pathlib import Path

import numpy as np
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


WORDS = "the of and to in a is that for it as was with be by on not he this are or his naïve café 東京 🙂".split()


def sample_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` random documents of 0 to 120 words (one empty), with some non-ASCII text."""
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, rng.integers(1, 120))) + "\n" for _ in range(n)]
    docs[n // 2] = ""
    return docs


def tiny_hf_tokenizer(directory: Path, corpus: list[str]) -> Path:
    """A byte-level BPE ``tokenizer.json`` (300 ids; ``<s>`` = 1, ``</s>`` = 2) trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path
