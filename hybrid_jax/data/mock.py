"""Synthetic, learnable token sequences: a fixed random Markov chain over the vocabulary.

Every token has ``BRANCHING`` likely successors, drawn once from the run's seed, taken with the fixed
probabilities ``SUCCESSOR_PROBS``. The best achievable cross-entropy is the entropy of those probabilities
(:data:`ENTROPY_FLOOR`, about 1.21 nats) while a model that has learned nothing sits at ``log(vocab_size)``,
so the loss of even a tiny model falls visibly within a couple of hundred steps.

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
      seed: fixes the transition table and, together with the index, every sequence.
    """

    def __init__(self, vocab_size: int, length: int, seed: int):
        if vocab_size < BRANCHING:
            raise ValueError(f"mock data needs vocab_size >= {BRANCHING}, got {vocab_size}")
        self.vocab_size, self.length, self.seed = vocab_size, length, seed
        rng = np.random.default_rng([seed, 0x5EED])
        # successors[v]: the BRANCHING distinct likely next tokens after v, most likely first.
        successors = np.stack([rng.choice(vocab_size, BRANCHING, replace=False) for _ in range(vocab_size)])
        self._successors = successors.tolist()  # Python lists: the per-token walk below is scalar indexing
        self._cum_probs = np.cumsum(SUCCESSOR_PROBS)

    @property
    def successors(self) -> np.ndarray:
        """``[vocab_size, BRANCHING]`` int: the transition table (row v: successors of token v)."""
        return np.asarray(self._successors)

    def __call__(self, index: int) -> np.ndarray:
        """Sequence number ``index`` (any non-negative int) -> ``[length]`` int32."""
        rng = np.random.default_rng([self.seed, int(index)])
        token = int(rng.integers(self.vocab_size))
        branches = np.searchsorted(self._cum_probs, rng.random(self.length - 1), side="right").tolist()
        out = [token]
        for b in branches:
            token = self._successors[token][b]
            out.append(token)
        return np.asarray(out, dtype=np.int32)
