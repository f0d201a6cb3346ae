"""cuDNN attention (NVIDIA) behind the flash kernel's signature, and ``impl="auto"``'s choice between cuDNN, the
Pallas flash kernel (:mod:`hybrid_jax.kernels.flash_attention`) and the XLA reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrid_jax.kernels import tuning


def cudnn_head_dim(q: jax.Array, v: jax.Array) -> int | None:
    """The head dim cuDNN would run (``max(Dqk, Dv)`` rounded up to 8), or ``None`` if it cannot run these inputs.

    cuDNN flash attention (through ``jax.nn.dot_product_attention``) wants bf16/fp16, one head dim for q, k
    and v (we zero-pad the smaller one) and head dims up to 128 here.
    """
    d = -(-max(q.shape[-1], v.shape[-1]) // 8) * 8
    ok = q.dtype in (jnp.bfloat16, jnp.float16) and d <= 128
    return d if ok else None


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    scale: float | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """cuDNN flash attention. Same shapes as :func:`flash_attention`; head dims zero-padded to one size.

    Zero columns added to q and k leave the scores unchanged; zero columns added to v are cut from the output.
    ``segment_ids [B,T]``: packed documents, as a ``[B,1,T,T]`` mask (cuDNN applies it as a bias: it does not
    skip the masked blocks).
    """
    d = cudnn_head_dim(q, v)
    if d is None:
        raise ValueError(f"cuDNN attention does not support q {q.shape} {q.dtype}, v {v.shape}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d - x.shape[-1])))
    mask = None if segment_ids is None else segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    o = jax.nn.dot_product_attention(pad(q), pad(k), pad(v), mask=mask, scale=scale, is_causal=causal,
                                     implementation="cudnn")
    return o[..., : v.shape[-1]]


def auto_impl(q: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *, offset: bool = False) -> str:
    """``impl="auto"``: ``"cudnn"`` on NVIDIA where cuDNN runs the shape, ``"pallas"`` on other GPUs and
    shapes, ``"xla"`` on CPU. cuDNN beat this kernel at every benchmarked shape on the H200
    (benchmarks/RESULTS.md, Attention), so it is preferred wherever it applies. With ``segment_ids`` (packed
    documents) this kernel, which skips the blocks outside each document; cuDNN would take them as a dense mask. With
    ``offset`` (queries at an offset in a longer key sequence: context parallelism) this kernel too."""
    dev = tuning.target_device()
    if dev.platform == "cpu":
        return "xla"
    if segment_ids is None and not offset and "nvidia" in dev.device_kind.lower() and cudnn_head_dim(q, v) is not None:
        return "cudnn"
    return "pallas"
