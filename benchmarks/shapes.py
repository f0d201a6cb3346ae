"""Benchmark shapes shared by our timings (JAX) and the reference timings (PyTorch/FLA), so both sides time the
same problems. No framework imports: the reference script must not import JAX (it would take the GPU's memory).

Recurrent shapes are at B8 T2048 (the anchors' batch): the anchor shapes of the reference benchmark and the
mixer shapes of our configs. Attention shapes are ``(B, T, H, Dqk, Dv)``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    """One chunked-recurrence problem: q/k ``[B,T,H,K]``, v ``[B,T,HV,V]``, gate ``[B,T,HV]`` (``[B,T,HV,K]`` when
    ``per_key``), beta ``[B,T,HV]`` when ``delta``."""

    name: str
    B: int
    T: int
    H: int  # q/k heads
    HV: int  # value heads
    K: int
    V: int
    delta: bool  # GDN (delta rule) or simple GLA
    per_key: bool = False  # KDA: a gate per key channel (with the delta rule)


SHAPES = [
    Shape("gdn_anchor", 8, 2048, 16, 16, 128, 128, True),
    Shape("ssd_anchor", 8, 2048, 32, 32, 128, 64, False),
    Shape("gdn_300m", 8, 2048, 4, 8, 64, 64, True),
    Shape("gdn_1b", 8, 2048, 8, 16, 64, 64, True),
    Shape("mamba2_300m", 8, 2048, 8, 32, 64, 64, False),
    Shape("kda_anchor", 8, 2048, 16, 16, 128, 128, True, per_key=True),
    Shape("kda_300m", 8, 2048, 8, 8, 32, 64, True, per_key=True),
    Shape("kda_1b", 8, 2048, 16, 16, 32, 64, True, per_key=True),
]

ATTENTION_SHAPES = {  # name: (B, T, H, Dqk, Dv)
    "B8 T2048 H16 D128": (8, 2048, 16, 128, 128),
    "300M MLA H16 qk64 v64": (8, 2048, 16, 64, 64),
    "1B MLA H32 qk64 v64": (8, 2048, 32, 64, 64),
    "3B MLA H24 qk128 v128": (8, 2048, 24, 128, 128),
}
