"""The chunked recurrent kernels (GDN, KDA, simple GLA / Mamba2 SSD): one Pallas family, Triton lowering.

Files, one concern each:
    block_math.py     in-kernel tile math: decayed Gram products, row blocks, the triangular inverse
    backward_math.py  in-kernel gradient math of one chunk
    refs.py           the ref views that change what a kernel's index means (loops, far rows, summed gates)
    launch.py         BlockSpecs, named-ref pallas calls, the multi-chunk and diagonal-block launch forms
    forward.py        the wy, state_fwd and output launches
    backward.py       the state_bwd and grad launches
    op.py             the custom_vjp op and its XLA glue: :func:`chunk_recurrence`
    context.py        GDN, KDA, GLA on one shard of a sequence split over devices (two passes, exact)
    prefix.py         chains of affine state maps over shards or groups of chunks (log-depth scans)
    search.py         the launch search space and per-stage inputs for sweeping launches
"""

from hybrid_jax.kernels.recurrent.backward import Residuals, grad, state_bwd
from hybrid_jax.kernels.recurrent.forward import output, state_fwd, wy
from hybrid_jax.kernels.recurrent.launch import Static
from hybrid_jax.kernels.recurrent.op import chunk_local_cumsum, chunk_recurrence, kernel_gate

__all__ = ["Residuals", "Static", "chunk_local_cumsum", "chunk_recurrence", "grad", "kernel_gate", "output",
           "state_bwd", "state_fwd", "wy"]
