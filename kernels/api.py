"""Public kernel functions and the ``impl`` dispatch (see ``hybrid_jax.kernels``)."""

from __future__ import annotations

from typing import Literal

import jax

from hybrid_jax.kernels.registry import OPS, implementation

Impl = Literal["auto", "xla", "pallas", "pallas_interpret", "naive"]


def _check_shapes(op: str, q, k, v, g, beta, per_key_gate: bool) -> None:
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"{op}: q and k must be [B,T,H,K] with equal shapes, got {q.shape} and {k.shape}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise ValueError(f"{op}: v must be [B,T,HV,V] with HV a multiple of H={H}, got {v.shape}")
    HV = v.shape[2]
    want_g = (B, T, HV, K) if per_key_gate else (B, T, HV)
    if g.shape != want_g:
        raise ValueError(f"{op}: g must have shape {want_g}, got {g.shape}")
    if beta is not None and beta.shape != (B, T, HV):
        raise ValueError(f"{op}: beta must have shape {(B, T, HV)}, got {beta.shape}")


def _check_segments(op: str, segment_ids, shape: tuple[int, ...]) -> None:
    if segment_ids is not None and (segment_ids.shape != shape[:2] or
                                    not jax.numpy.issubdtype(segment_ids.dtype, jax.numpy.integer)):
        raise ValueError(f"{op}: segment_ids must be integers of shape {shape[:2]} ([B,T]), got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")


def _recurrence(op: str, q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
                chunk_size, impl, segment_ids):
    """``registry.OPS[op]``'s implementation for ``impl`` on these arrays -> ``(o, final state or None)``."""
    fn = implementation(op, impl)
    _check_segments(OPS[op].function, segment_ids, q.shape)
    o, final = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                  chunk_size=chunk_size, segment_ids=segment_ids)
    return o, (final if output_final_state else None)


def chunk_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    scale: float | None = None, initial_state: jax.Array | None = None, output_final_state: bool = False,
    use_qk_l2norm: bool = False, chunk_size: int | None = None, impl: Impl = "auto",
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated DeltaNet. ``q, k: [B,T,H,K]``; ``v: [B,T,HV,V]``; ``g`` (log decay), ``beta: [B,T,HV]``.

    Per value head: ``S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = scale S_t^T q_t``.
    ``chunk_size=None``: the Pallas kernels' tuned chunk for this GPU and gate kind (``kernels.tuning``: 64; KDA
    16), 64 for the XLA form. Returns ``(o [B,T,HV,V], final_state [B,HV,K,V] float32 or None)``.

    ``segment_ids [B,T]`` int (packed documents: a nondecreasing document index; ``None``: one sequence): the state
    restarts from zero at the first token of each new document; the window's first document starts from
    ``initial_state``, and ``final_state`` is the last document's. Every implementation computes it exactly (a
    segment-aware chunk form, not a gate: ``reference.chunked_recurrence``).
    """
    _check_shapes("chunk_gated_delta_rule", q, k, v, g, beta, per_key_gate=False)
    return _recurrence("gdn", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                       chunk_size=chunk_size, impl=impl, segment_ids=segment_ids)


def chunk_kda(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    scale: float | None = None, initial_state: jax.Array | None = None, output_final_state: bool = False,
    use_qk_l2norm: bool = False, chunk_size: int | None = None, impl: Impl = "auto",
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention: as :func:`chunk_gated_delta_rule` (``segment_ids`` too) with a decay per key channel,
    ``g: [B,T,HV,K]``."""
    _check_shapes("chunk_kda", q, k, v, g, beta, per_key_gate=True)
    return _recurrence("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                       chunk_size=chunk_size, impl=impl, segment_ids=segment_ids)


def chunk_simple_gla(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, *,
    scale: float | None = None, initial_state: jax.Array | None = None, output_final_state: bool = False,
    chunk_size: int | None = None, impl: Impl = "auto", segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Scalar-gated linear attention: ``S_t = exp(g_t) S_{t-1} + k_t v_t^T;  o_t = scale S_t^T q_t``.

    ``q, k: [B,T,H,K]``, ``v: [B,T,HV,V]``, ``g: [B,T,HV]``. Mamba2's SSD is this with q=C, k=B, v=dt*x,
    g=dt*A, scale=1. ``segment_ids``: as in :func:`chunk_gated_delta_rule`.
    """
    _check_shapes("chunk_simple_gla", q, k, v, g, None, per_key_gate=False)
    return _recurrence("gla", q, k, v, g, None, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=False,
                       chunk_size=chunk_size, impl=impl, segment_ids=segment_ids)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, scale: float | None = None,
    impl: Impl = "auto", segment_ids: jax.Array | None = None, q_offset: int | jax.Array | None = None,
) -> jax.Array:
    """Softmax attention. ``q: [B,Tq,H,Dqk]``; ``k: [B,Tk,H,Dqk]``; ``v: [B,Tk,H,Dv]`` -> ``[B,Tq,H,Dv]``; scale
    ``Dqk**-0.5``.

    The queries are the tokens at positions ``q_offset .. q_offset + Tq - 1`` of the keys' sequence (an int or a
    traced int scalar, ``0 <= q_offset <= Tk - Tq``: a context shard's queries over the whole sequence's keys;
    ``None``: ``Tk - Tq``, 0 for self-attention); the causal mask is taken at those positions.
    ``impl="auto"``: cuDNN on NVIDIA where it runs the shape (self-attention only), the Pallas flash kernel on other
    GPUs, XLA on CPU (``kernels/cudnn_attention.py::auto_impl``). ``"xla"`` and ``"naive"`` are the plain float32
    softmax. ``segment_ids [B,Tk]`` int (packed documents of the keys' sequence, nondecreasing): a query sees only its
    own document's keys; the flash kernel then skips the key blocks wholly before the document.
    """
    from hybrid_jax.kernels.cudnn_attention import auto_impl, cudnn_attention
    from hybrid_jax.kernels.flash_blocks import has_offset

    _check_segments("attention", segment_ids, k.shape)
    offset = has_offset(q_offset, q.shape[1], k.shape[1])
    if impl == "auto" and (impl := auto_impl(q, v, segment_ids, offset=offset)) == "cudnn":
        try:  # cuDNN checks the shape when traced, for training too (e.g. it refuses an odd T there)
            return cudnn_attention(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)
        except NotImplementedError:
            impl = "pallas"
    return implementation("attention", impl)(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                             q_offset=q_offset)
