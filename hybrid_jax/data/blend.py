"""Weighted blends of token datasets, written in ``data.path`` (and ``data.validation_path``) as Megatron writes
them: ``"0.7 path/a 0.3 path/b"``; a single path is a blend of one. Each path's format is detected
(:func:`~hybrid_jax.data.source.open_source`), so ours and Megatron's mix.

The interleaving is exact and deterministic: sample ``i`` of the blended stream goes to the source furthest behind
its share, the source ``d`` with the largest ``w_d (i + 1) - c_d`` (``c_d`` its samples so far; ties to the first
listed), as Megatron's blending does, in exact integer arithmetic. The weights, normalised, are whole numbers
``p_d`` of a period ``P = sum(p_d)``. The deficits before a pick add up to one sample, so the largest is positive and
no source ever gets a whole sample ahead of its share (with two sources, none falls a whole sample behind either);
at ``i + 1 = P`` that leaves every ``c_d <= p_d`` with ``sum(c_d) = P``: each source has had exactly its ``p_d``, the
deficits are back to zero, and the order repeats with period ``P``. One period is laid out once
(:class:`BlendSchedule`), and the source of any sample and every source's count after ``N`` samples follow in O(1)
and O(P) numpy, whatever ``N``: a run resumed at sequence ``10**8`` computes them at once. Weights whose exact
period would exceed :data:`MAX_PERIOD` samples are rounded to multiples of ``1 / MAX_PERIOD`` (said in a note).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import grain
import numpy as np

from hybrid_jax.data.source import TokenSource, open_source

MAX_PERIOD = 1 << 16


class BlendError(ValueError):
    """A blend string that cannot be read; the message says what to write instead."""


def parse_blend(spec: str, key: str = "data.path") -> list[tuple[Fraction, str]]:
    """``"0.7 a 0.3 b"`` -> ``[(7/10, "a"), (3/10, "b")]``; a lone path -> ``[(1, path)]``. BlendError (one line)
    for a bad weight or an odd number of fields."""
    fields = spec.split()
    if len(fields) == 1:
        return [(Fraction(1), fields[0])]
    if not fields or len(fields) % 2:
        raise BlendError(f"{key}={spec!r}: give one dataset path, or weight-path pairs as Megatron's --data-path "
                         "takes them, e.g. '0.7 data/a 0.3 data/b'")
    pairs = []
    for weight, path in zip(fields[::2], fields[1::2], strict=True):
        try:
            value = Fraction(weight)
        except (ValueError, ZeroDivisionError):
            raise BlendError(f"{key}: the weight {weight!r} before {path} is not a number; write weight-path pairs, "
                             "e.g. '0.7 data/a 0.3 data/b'") from None
        if value <= 0:
            raise BlendError(f"{key}: the weight {weight} of {path} must be positive (leave a dataset out instead)")
        pairs.append((value, path))
    return pairs


def integer_shares(weights: list[Fraction]) -> tuple[list[int], str | None]:
    """Normalised weights as whole samples per period ``[D]`` (their exact ratio, or rounded to :data:`MAX_PERIOD`
    by largest remainder with at least 1 each) and a note when rounded."""
    scale = math.lcm(*(w.denominator for w in weights))
    exact = [int(w * scale) for w in weights]
    g = math.gcd(*exact)
    exact = [p // g for p in exact]
    if sum(exact) <= MAX_PERIOD:
        return exact, None
    total = sum(weights)
    ideal = [w / total * MAX_PERIOD for w in weights]
    shares = [max(1, math.floor(x)) for x in ideal]
    for d in sorted(range(len(shares)), key=lambda d: ideal[d] - math.floor(ideal[d]), reverse=True):
        if sum(shares) >= MAX_PERIOD:
            break
        shares[d] += 1
    return shares, f"note: the blend weights are rounded to multiples of 1/{MAX_PERIOD} (a period of {sum(shares):,} " \
                   "samples)"


class BlendSchedule(grain.transforms.DatasetSelectionMap):
    """Which source each sample of the blended stream comes from: a Grain ``DatasetSelectionMap`` (global sample
    ``i`` -> ``(source d, that source's sample j)``) of one laid-out period.

    Args:
      shares: ``[D]`` samples of each source per period (:func:`integer_shares`).
    """

    def __init__(self, shares: list[int]):
        period = sum(shares)
        self.shares = np.asarray(shares, np.int64)  # [D]
        self.choice = np.empty(period, np.int32)  # [P] the source of each sample of a period
        self.rank = np.empty(period, np.int64)  # [P] its index among that source's samples of the period
        counts = [0] * len(shares)
        for i in range(period):  # deficit of d after sample i: p_d (i + 1) - P c_d; the largest, first on ties
            d = max(range(len(shares)), key=lambda d: (shares[d] * (i + 1) - period * counts[d], -d))
            self.choice[i], self.rank[i] = d, counts[d]
            counts[d] += 1
        if counts != list(shares):  # no source gets a sample ahead, so a period ends exactly on the shares
            raise AssertionError(f"blend period of {shares} ended at {counts}")

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> tuple[int, int]:
        cycle, r = divmod(int(index), self.choice.size)
        d = int(self.choice[r])
        return d, cycle * int(self.shares[d]) + int(self.rank[r])

    def counts(self, samples: int) -> np.ndarray:
        """``[D]`` int64: each source's samples among the first ``samples`` of the stream."""
        cycle, r = divmod(int(samples), self.choice.size)
        return cycle * self.shares + np.bincount(self.choice[:r], minlength=self.shares.size)


@dataclasses.dataclass(frozen=True)
class Blend:
    """The training (or validation) data opened once: its sources, their shares of a period, and their labels in the
    metrics. ``note``: what to print at the start about the weights (None when exact)."""

    sources: tuple[TokenSource, ...]
    shares: tuple[int, ...]
    labels: tuple[str, ...]
    note: str | None = None

    @property
    def weights(self) -> list[float]:
        return [p / sum(self.shares) for p in self.shares]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sources)

    def schedule(self) -> BlendSchedule:
        """The interleaving (laid out once per process: up to :data:`MAX_PERIOD` Python steps)."""
        return self._schedule

    @functools.cached_property
    def _schedule(self) -> BlendSchedule:
        return BlendSchedule(list(self.shares))

    def describe(self) -> list[str]:
        """The lines to print at the start: each source with its weight."""
        if len(self.sources) == 1:
            return [f"data: {self.sources[0].describe()}"]
        return [f"data: a blend of {len(self.sources)} datasets"] + [
            f"  {w:.4f} {s.describe()}, tokens counted as data_tokens/{label}"
            for w, s, label in zip(self.weights, self.sources, self.labels, strict=True)
        ] + ([self.note] if self.note else [])


def open_blend(spec: str, expect: str = "tokens", key: str = "data.path") -> Blend:
    """Parse ``spec`` (one path or weight-path pairs) and open each dataset once. BlendError, FileNotFoundError or
    DatasetError (one line) for a bad weight or path."""
    pairs = parse_blend(spec, key)
    sources = []
    for _, path in pairs:
        try:
            sources.append(open_source(path, expect))
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{e}" if len(pairs) == 1 else f"{path} (in the blend): {e}") from None
    shares, note = integer_shares([w for w, _ in pairs])
    return Blend(tuple(sources), tuple(shares), _labels([p for _, p in pairs]), note)


def _labels(paths: list[str]) -> tuple[str, ...]:
    """A short name per path for the metrics (its last component, made unique)."""
    labels: list[str] = []
    for path in paths:
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path.rstrip("/")).name) or "data"
        label, n = base, 2
        while label in labels:
            label, n = f"{base}-{n}", n + 1
        labels.append(label)
    return tuple(labels)
