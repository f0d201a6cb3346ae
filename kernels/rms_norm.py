"""RMSNorm, and the pre-norm residual stream's add with the RMSNorm after it as one op whose forward and backward
are each one Pallas (Triton lowering) kernel.

Between two sublayers the stream is formed from the one before the sublayer ``x`` and the sublayer's output ``y``,
and normalised at once for the next sublayer (the last time for the final norm)::

    s = x + y                                       x's dtype (the compute dtype)
    h = s * r * w,   r = rsqrt(mean(s^2) + eps)     float32 from the stored s, rounded once to out_dtype

XLA makes two passes over the rows each way: forward the add fused with the row sums (writing ``s``), then ``h``
from ``s``; backward the row sums ``mean(g * n)``, then the gradient added to the stream's. The kernels make one:
forward reads ``x`` and ``y`` and writes ``s`` and ``h``; backward, from the stream's cotangent ``ds`` (the later
sublayers') and ``dh``, with ``n = s * r`` (``r`` recomputed from ``s``)::

    g = dh * w;   dx = dy = ds + r * (g - n * mean(g * n));   dw = sum over rows of dh * n

reads ``s``, ``ds`` and ``dh`` and writes ``dx`` once (the same array is both inputs' gradient); its programs add
``dw``'s terms over the rows they take and XLA adds the programs' sums. Where nothing later reads ``s`` (the final
norm) the backward has no ``ds`` (a symbolic zero: no array of zeros is made for it). Rows of ``D`` channels not a
power of two are masked to the next one.

``impl``: ``auto`` (Pallas on a GPU, else XLA), ``xla`` (and ``naive``: the plain formula, differentiated by JAX),
``pallas``, ``pallas_interpret``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.registry import pallas_or_xla
from hybrid_jax.kernels.row_tiles import load_rows, store_rows, sweep_tiles

F32 = jnp.float32


def rms_norm(x: jax.Array, w: jax.Array, *, eps: float, out_dtype: jnp.dtype) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last axis of ``x [..., D]``, ``w [D]``: float32 arithmetic, the
    result in ``out_dtype`` (XLA; differentiated by JAX)."""
    return _normalized(x.astype(F32), w.astype(F32), x.shape[-1], eps).astype(out_dtype)


def add_rms_norm(x: jax.Array, y: jax.Array, w: jax.Array, *, eps: float, out_dtype: jnp.dtype,
                 impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``(s, h)``: the stream ``s = x + y`` in their dtype and ``h = rms_norm(s, w)`` in ``out_dtype`` of ``x, y
    [..., D]`` (one dtype) and ``w [D]``; differentiable in all three (gradients in their dtypes), both ways by
    ``impl``."""
    if y.shape != x.shape or y.dtype != x.dtype or w.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: need x, y [..., D] of one dtype and w [D], got x {x.dtype}{list(x.shape)}, "
                         f"y {y.dtype}{list(y.shape)} and w {list(w.shape)}")
    impl = pallas_or_xla(impl, "add_rms_norm")
    if impl == "xla":
        s = x + y
        return s, rms_norm(s, w, eps=eps, out_dtype=out_dtype)
    return _fused(x, y, w, float(eps), jnp.dtype(out_dtype), impl == "pallas_interpret")


def _normalized(s: jax.Array, w: jax.Array, d: int, eps: float) -> jax.Array:
    """``s * rsqrt(sum(s^2) / d + eps) * w`` of float32 rows ``s [..., width]`` (columns past ``d`` zero) and ``w``
    broadcasting against them: the XLA form's and the forward kernel's arithmetic."""
    return s * jax.lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) / d + eps) * w


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, y, w, eps, out_dtype, interpret):
    return _pallas_forward(x, y, w, eps, out_dtype, tuning.NormConfig(), interpret=interpret)


def _fused_fwd(x, y, w, eps, out_dtype, interpret):
    s, h = _fused(x.value, y.value, w.value, eps, out_dtype, interpret)
    return (s, h), (s, w.value)


def _fused_bwd(eps, out_dtype, interpret, residuals, cotangents):
    """``ds`` is ``None`` to the kernel where no later op reads ``s`` (the final norm): no zeros are made for it."""
    s, w = residuals
    ds, dh = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    dh = jnp.zeros(s.shape, out_dtype) if dh is None else dh
    dx, dw = _pallas_backward(ds, dh, s, w, eps, tuning.NormConfig(), interpret=interpret)
    return dx, dx, dw.astype(w.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def _pallas_forward(x: jax.Array, y: jax.Array, w: jax.Array, eps: float, out_dtype: jnp.dtype,
                    config: tuning.NormConfig, *, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """``(s, h)`` over the rows ``[R, D]``, one program per tile of ``config.tile_rows(D)`` rows."""
    D = x.shape[-1]
    R = x.size // D
    rows = config.tile_rows(D)
    whole = pl.BlockSpec((R, D), lambda p: (0, 0))
    s, h = pl.pallas_call(
        functools.partial(_forward_kernel, n_rows=R, rows=rows, width=pl.next_power_of_2(D), eps=eps),
        grid=(pl.cdiv(R, rows),), in_specs=[whole, whole, pl.BlockSpec((1, D), lambda p: (0, 0))],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((R, D), x.dtype), jax.ShapeDtypeStruct((R, D), out_dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret, name="add_rms_norm_fwd",
    )(x.reshape(R, D), y.reshape(R, D), w.reshape(1, D).astype(F32))
    return s.reshape(x.shape), h.reshape(x.shape)


def _forward_kernel(x_ref, y_ref, w_ref, s_ref, h_ref, *, n_rows: int, rows: int, width: int, eps: float):
    """``x_ref, y_ref [R, D]`` (every row), ``w_ref [1, D]`` float32; out ``s_ref, h_ref [R, D]``, this program's
    tile of ``rows`` rows (rows past ``R`` and columns past ``D`` masked; ``width``: ``D`` padded to a power of
    two)."""
    D = w_ref.shape[1]
    w = load_rows(w_ref, width)

    def tile(xy, store, _):
        s = (xy[0] + xy[1]).astype(s_ref.dtype)
        store(s_ref, s)
        store(h_ref, _normalized(s.astype(F32), w, D, eps))

    sweep_tiles(tile, None, (x_ref, y_ref), n_rows=n_rows, rows=rows, per_program=1, width=width, d=D)


def _pallas_backward(ds: jax.Array | None, dh: jax.Array, s: jax.Array, w: jax.Array, eps: float,
                     config: tuning.NormConfig, *, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """``(dx in s's dtype, dw [D] float32)`` over the rows ``[R, D]`` (``ds`` None: zero): ``config.backward_programs``
    programs take the tiles of ``config.tile_rows(D)`` rows in turn, each writing its partial sums of ``dw``
    (``[programs, rows, D]``; XLA adds them up)."""
    D = s.shape[-1]
    R = s.size // D
    rows = config.tile_rows(D)
    programs, per_program = config.backward_programs(pl.cdiv(R, rows))
    whole = pl.BlockSpec((R, D), lambda p: (0, 0))
    dx, dw = pl.pallas_call(
        functools.partial(_backward_kernel, n_rows=R, rows=rows, per_program=per_program,
                          width=pl.next_power_of_2(D), eps=eps, with_ds=ds is not None),
        grid=(programs,), in_specs=[whole] * (3 if ds is not None else 2) + [pl.BlockSpec((1, D), lambda p: (0, 0))],
        out_specs=[whole, pl.BlockSpec((None, rows, D), lambda p: (p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((R, D), s.dtype), jax.ShapeDtypeStruct((programs, rows, D), F32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret, name="add_rms_norm_bwd",
    )(*([] if ds is None else [ds.reshape(R, D)]), dh.reshape(R, D), s.reshape(R, D), w.reshape(1, D).astype(F32))
    return dx.reshape(s.shape), jnp.sum(dw, axis=(0, 1))


def _backward_kernel(*refs, n_rows: int, rows: int, per_program: int, width: int, eps: float, with_ds: bool):
    """``ds_ref`` (``with_ds``), ``dh_ref, s_ref [R, D]`` (every row), ``w_ref [1, D]`` float32; out ``dx_ref [R, D]``
    (this program's tiles written) and ``dw_ref [rows, D]`` float32 (dw's terms summed over this program's tiles, per
    row of a tile), the tiles taken as :func:`sweep_tiles` does."""
    ds_ref, (dh_ref, s_ref, w_ref, dx_ref, dw_ref) = (refs[0], refs[1:]) if with_ds else (None, refs)
    D = w_ref.shape[1]
    w = load_rows(w_ref, width)

    def tile(tiles, store, acc):
        dh, s = tiles[-2:]
        r = jax.lax.rsqrt(jnp.sum(s * s, axis=1, keepdims=True) / D + eps)
        n = s * r
        g = dh * w
        dx = r * (g - n * (jnp.sum(g * n, axis=1, keepdims=True) / D))
        store(dx_ref, dx if ds_ref is None else tiles[0] + dx)
        return acc + dh * n

    reads = (dh_ref, s_ref) if ds_ref is None else (ds_ref, dh_ref, s_ref)
    acc = sweep_tiles(tile, jnp.zeros((rows, width), F32), reads, n_rows=n_rows, rows=rows, per_program=per_program,
                      width=width, d=D)
    store_rows(dw_ref, acc)
