"""Benchmark problems shared by our timings (JAX) and the reference timings (PyTorch/FLA), so both sides time the same
problems: named :class:`Problem` lists. The reference script imports this in a PyTorch process: importing it
initialises no JAX backend (which would take the GPU's memory; ``tests/benchmarks/test_shapes.py`` checks it).

Recurrent problems are at B8 T2048 (the anchors' batch): the anchor shapes of the reference benchmark and the mixer
shapes of our configs, bf16. Attention problems: ``K`` the qk head dim, ``V`` the v head dim, ``HV == H``.
"""

from __future__ import annotations

from hybrid_jax.kernels.tooling.problems import Problem

SHAPES = [
    Problem("gdn", 8, 2048, 16, 16, 128, 128, name="gdn_anchor"),
    Problem("gla", 8, 2048, 32, 32, 128, 64, name="ssd_anchor"),
    Problem("gdn", 8, 2048, 4, 8, 64, 64, name="gdn_300m"),
    Problem("gdn", 8, 2048, 8, 16, 64, 64, name="gdn_1b"),
    Problem("gla", 8, 2048, 8, 32, 64, 64, name="mamba2_300m"),
    Problem("kda", 8, 2048, 16, 16, 128, 128, name="kda_anchor"),
    Problem("kda", 8, 2048, 8, 8, 32, 64, name="kda_300m"),
    Problem("kda", 8, 2048, 16, 16, 32, 64, name="kda_1b"),
]

ATTENTION_SHAPES = [
    Problem("attention", 8, 2048, 16, 16, 128, 128, name="B8 T2048 H16 D128"),
    Problem("attention", 8, 2048, 16, 16, 64, 64, name="300M MLA H16 qk64 v64"),
    Problem("attention", 8, 2048, 32, 32, 64, 64, name="1B MLA H32 qk64 v64"),
    Problem("attention", 8, 2048, 24, 24, 128, 128, name="3B MLA H24 qk128 v128"),
]


def by_name(names: list[str] | None, problems: list[Problem] = SHAPES) -> list[Problem]:
    """The problems named in ``names``, in that order (all of them when ``names`` is empty or None); an unknown name
    is a ``SystemExit`` listing the known ones."""
    known = {p.name: p for p in problems}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(known)}")
    return [known[n] for n in names] if names else list(problems)
