"""Synthetic, learnable token sequences: a fixed random Markov chain over the vocabulary.

The vocabulary is put on one random cycle (a permutation drawn from the run's seed). From a token the chain
moves 1, 2, ... ``BRANCHING`` places along the cycle with the fixed probabilities ``SUCCESSOR_PROBS``, so
every token has ``BRANCHING`` distinct, arbitrary-looking likely successors. The best achievable
cross-entropy is the entropy of those probabilities (:data:`ENTROPY_FLOOR`, about 1.21 nats) while a model
that has learned nothing sits at ``log(vocab_size)``, so the loss of even a tiny model falls visibly within a
couple of hundred steps. Positions on the cycle are a cumulative sum of the moves, so a sequence is built
with a few vectorized numpy calls (no per-token Python loop).

Sequence ``i`` is a pure function of ``(seed, i)``: the stream needs no storage, any element can be
produced on its own (Grain random access, worker processes, exact resume), and two runs with the same seed
see identical data.
"""

from __future__ import annotations

import math

import numpy as np

SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.1)
BRANCHING = len(SUCCESSOR_PROBS)
ENTROPY_FLOOR = -sum(p * math.log(p) for p in SUCCESSOR_PROBS)


class MarkovSequences:
    """Maps a global sequence index to ``length`` int32 tokens of the chain.

    Args:
      vocab_size: number of token ids; the chain's states.
      length: tokens per sequence (``seq_len + 1`` for training windows).
      seed: fixes the cycle and, together with the index, every sequence.
    """

    def __init__(self, vocab_size: int, length: int, seed: int):
        if vocab_size <= BRANCHING:
            raise ValueError(f"mock data needs vocab_size > {BRANCHING}, got {vocab_size}")
        self.vocab_size, self.length, self.seed = vocab_size, length, seed
        self._cycle = np.random.default_rng([seed, 0x5EED]).permutation(vocab_size).astype(np.int32)
        self._cum_probs = np.cumsum(SUCCESSOR_PROBS)

    @property
    def successors(self) -> np.ndarray:
        """``[vocab_size, BRANCHING]`` int: row v holds the successors of token v, most likely first."""
        position = np.argsort(self._cycle)  # position[v]: where token v sits on the cycle
        return self._cycle[(position[:, None] + np.arange(1, BRANCHING + 1)) % self.vocab_size]

    def __call__(self, index: int) -> np.ndarray:
        """Sequence number ``index`` (any non-negative int) -> ``[length]`` int32."""
        rng = np.random.default_rng([self.seed, int(index)])
        moves = np.empty(self.length, dtype=np.int64)
        moves[0] = rng.integers(self.vocab_size)  # the starting position
        moves[1:] = 1 + np.searchsorted(self._cum_probs, rng.random(self.length - 1), side="right")
        return self._cycle[np.cumsum(moves) % self.vocab_size]


class MockDocuments:
    """Segment ids for mock windows (``data.document_mask``): window ``index`` cut into documents of random lengths
    (uniform in ``1 .. max_length``), a pure function of ``(seed, index)`` like the tokens.

    Args:
      length: tokens per window.
      max_length: the longest document.
      seed: the run's seed.
    """

    def __init__(self, length: int, max_length: int, seed: int):
        self.length, self.max_length, self.seed = length, max(1, max_length), seed

    def __call__(self, index: int) -> np.ndarray:
        """``[length]`` int32 nondecreasing document index, starting at 0."""
        rng = np.random.default_rng([self.seed, int(index), 0xD0C])
        lengths = rng.integers(1, self.max_length + 1, size=self.length)  # more than enough documents
        return np.repeat(np.arange(self.length, dtype=np.int32), lengths)[: self.length]
