"""The short causal depthwise conv with SiLU (``ShortConv``), its backward in one Pallas (Triton lowering) kernel.

For ``xp [B, K-1+T, C]`` (the ``K-1`` inputs before the first output, then the inputs), ``w [K, C]``, an optional
``bias [C]`` and optional document ids ``segment_ids [B, K-1+T]`` of xp's rows, output ``t`` is::

    keep_j[t] = segment_ids[t+j] == segment_ids[t+K-1]      (True without ids: tap j reads t's document)
    pre[t]    = sum_j keep_j[t] * xp[t+j] * w[j] + bias;    y[t] = silu(pre[t])

Forward: XLA, one fused pass (float32 sums and SiLU, ``y`` rounded once to ``out_dtype``). Backward, from ``dy``,
with ``dpre = dy * silu'(pre)`` (``pre`` recomputed: the residuals are the inputs)::

    dxp[s] = sum_j keep_j[s-j] * dpre[s-j] * w[j]   (t = s-j in [0, T));   dw[j] = sum_{b,t} keep_j[t] xp[t+j] dpre[t]

XLA writes ``dxp`` as a concatenation of the K shifted terms and ``dw`` as K more reductions over the activations;
the kernel, per tile of xp's rows, loads ``dy`` and ``xp`` (and the ``K-1`` rows on either side), recomputes ``dpre``
at the K shifts it needs, and writes ``dxp`` and the tile's partial sums of ``dw`` and ``dbias``.

``impl``: ``auto`` (Pallas on a GPU, else XLA), ``xla`` (and ``naive``), ``pallas``, ``pallas_interpret``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.registry import pallas_or_xla

F32 = jnp.float32


def short_conv_silu(xp: jax.Array, w: jax.Array, bias: jax.Array | None, segment_ids: jax.Array | None, *,
                    out_dtype: jnp.dtype, impl: str = "auto") -> jax.Array:
    """``y [B, T, C]`` in ``out_dtype`` of ``xp [B, K-1+T, C]``, ``w [K, C]``, ``bias [C]`` or None and
    ``segment_ids [B, K-1+T]`` int or None (see the module's formula); differentiable in ``xp``, ``w`` and ``bias``
    (gradients in their dtypes), its backward by ``impl``."""
    B, S, C = xp.shape
    if w.ndim != 2 or w.shape[1] != C or S < w.shape[0] or (bias is not None and bias.shape != (C,)) or (
            segment_ids is not None and segment_ids.shape != (B, S)):
        raise ValueError(f"short_conv_silu: need xp [B, K-1+T, C], w [K, C], bias [C] and segment_ids [B, K-1+T], "
                         f"got {xp.shape}, {w.shape}, {None if bias is None else bias.shape} and "
                         f"{None if segment_ids is None else segment_ids.shape}")
    return _short_conv(xp, w, bias, segment_ids, jnp.dtype(out_dtype), pallas_or_xla(impl, "short_conv_silu"))


def _keeps(segment_ids: jax.Array | None, K: int) -> list[jax.Array] | None:
    """Per tap j ``[B, T, 1]`` bool: tap j of output t reads t's document (None without ids)."""
    if segment_ids is None:
        return None
    T, own = segment_ids.shape[1] - K + 1, segment_ids[:, K - 1 :]
    return [(segment_ids[:, j : j + T] == own)[..., None] for j in range(K)]


def _taps(xp: jax.Array, K: int, keeps: list[jax.Array] | None) -> list[jax.Array]:
    """The K float32 taps ``[B, T, C]`` (tap j of output t: ``xp[t+j]``), those of another document zero."""
    T = xp.shape[1] - K + 1
    taps = [xp[:, j : j + T].astype(F32) for j in range(K)]
    return taps if keeps is None else [jnp.where(keep, tap, 0.0) for tap, keep in zip(taps, keeps, strict=True)]


def _pre(taps: list[jax.Array], w: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``sum_j taps[j] * w[j] (+ bias)`` in float32, summed in tap order."""
    w = w.astype(F32)
    pre = sum(tap * w[j] for j, tap in enumerate(taps))
    return pre if bias is None else pre + bias.astype(F32)


def _forward(xp, w, bias, segment_ids, out_dtype):
    K = w.shape[0]
    return jax.nn.silu(_pre(_taps(xp, K, _keeps(segment_ids, K)), w, bias)).astype(out_dtype)


def short_conv_backward_reference(dy: jax.Array, xp: jax.Array, w: jax.Array, bias: jax.Array | None,
                                  segment_ids: jax.Array | None
                                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The XLA form of the backward (and the kernel's reference) for ``dy [B, T, C]``: ``(dxp [B, K-1+T, C]`` in
    ``xp``'s dtype, ``dw [K, C]`` float32, ``dbias [C]`` float32 or None without a bias)."""
    K = w.shape[0]
    keeps = _keeps(segment_ids, K)
    taps = _taps(xp, K, keeps)
    pre = _pre(taps, w, bias)
    sig = jax.nn.sigmoid(pre)
    dpre = dy.astype(F32) * sig * (1 + pre * (1 - sig))
    wf = w.astype(F32)
    dxp = 0.0
    for j in range(K):  # dpre[t] * w[j] reaches xp[t+j]
        g = dpre * wf[j] if keeps is None else jnp.where(keeps[j], dpre * wf[j], 0.0)
        dxp = dxp + jnp.pad(g, ((0, 0), (j, K - 1 - j), (0, 0)))
    dw = jnp.stack([jnp.sum(tap * dpre, axis=(0, 1)) for tap in taps])
    dbias = None if bias is None else jnp.sum(dpre, axis=(0, 1))
    return dxp.astype(xp.dtype), dw, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _short_conv(xp, w, bias, segment_ids, out_dtype: jnp.dtype, impl: str) -> jax.Array:
    return _forward(xp, w, bias, segment_ids, out_dtype)


def _short_conv_fwd(xp, w, bias, segment_ids, out_dtype, impl):
    return _forward(xp, w, bias, segment_ids, out_dtype), (xp, w, bias, segment_ids)


def _short_conv_bwd(out_dtype, impl, residuals, dy):
    xp, w, bias, segment_ids = residuals
    if impl == "xla":
        dxp, dw, dbias = short_conv_backward_reference(dy, xp, w, bias, segment_ids)
    else:
        dxp, dw, dbias = _pallas_backward(dy, xp, w, bias, segment_ids, tuning.ShortConvConfig(),
                                          interpret=impl == "pallas_interpret")
    return dxp, dw.astype(w.dtype), None if bias is None else dbias.astype(bias.dtype), None


_short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)


def _pallas_backward(dy: jax.Array, xp: jax.Array, w: jax.Array, bias: jax.Array | None,
                     segment_ids: jax.Array | None, config: tuning.ShortConvConfig, *, interpret: bool
                     ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The kernel, grid ``(B, row blocks of xp, channel blocks)`` (a row block: ``config.tiles`` tiles of
    ``config.rows``): the reference's ``(dxp, dw, dbias)``, ``dw`` and ``dbias`` summed by XLA from each program's
    partial sums ``[B, row blocks, K, C]`` / ``[B, row blocks, C]``."""
    B, S, C = xp.shape
    K, T = w.shape[0], dy.shape[1]
    rows, channels = min(config.rows, pl.next_power_of_2(S)), min(config.channels, pl.next_power_of_2(C))
    tiles = min(config.tiles, pl.cdiv(S, rows))  # row tiles per program
    grid = (B, pl.cdiv(S, rows * tiles), pl.cdiv(C, channels))

    def sequence(length):  # a [length, channels] slab of a [B, length, C] tensor: the kernel loads shifted rows
        return pl.BlockSpec((None, length, channels), lambda b, r, c: (b, 0, c))

    inputs = [dy, xp, w.astype(F32)]
    in_specs = [sequence(T), sequence(S), pl.BlockSpec((K, channels), lambda b, r, c: (0, c))]
    if bias is not None:
        inputs.append(bias.astype(F32))
        in_specs.append(pl.BlockSpec((channels,), lambda b, r, c: (c,)))
    if segment_ids is not None:
        inputs.append(segment_ids.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None, S), lambda b, r, c: (b, 0)))
    out_shape = [jax.ShapeDtypeStruct((B, S, C), xp.dtype), jax.ShapeDtypeStruct((B, grid[1], K, C), F32)]
    out_specs = [pl.BlockSpec((None, rows * tiles, channels), lambda b, r, c: (b, r, c)),
                 pl.BlockSpec((None, None, K, channels), lambda b, r, c: (b, r, 0, c))]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((B, grid[1], C), F32))
        out_specs.append(pl.BlockSpec((None, None, channels), lambda b, r, c: (b, r, c)))
    dxp, dw, *dbias = pl.pallas_call(
        functools.partial(_backward_kernel, width=C, tiles=tiles, has_bias=bias is not None,
                          has_ids=segment_ids is not None),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret,
        name="short_conv_bwd",
    )(*inputs)
    return dxp, jnp.sum(dw, axis=(0, 1)), jnp.sum(dbias[0], axis=(0, 1)) if dbias else None


def _backward_kernel(*refs, width: int, tiles: int, has_bias: bool, has_ids: bool):
    """``dy_ref [T, BC]`` (dy's dtype), ``xp_ref [S, BC]``, ``w_ref [K, BC]``, ``bias_ref [BC]`` (with a bias),
    ``ids_ref [S]`` int32 (with ids): this channel block's whole sequence; out ``dxp_ref [tiles * BT, BC]`` (this
    program's rows of xp, ``tiles`` tiles of ``BT`` rows in turn), ``dw_ref [K, BC]`` and ``dbias_ref [BC]`` (with a
    bias): sums over its rows. ``S = K-1+T``, columns past ``width`` (= C) and rows past the sequence masked, float32
    arithmetic."""
    dy_ref, xp_ref, w_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    ids_ref = refs.pop(0) if has_ids else None
    dxp_ref, dw_ref, *dbias_refs = refs
    K, BC = w_ref.shape
    BT, S = dxp_ref.shape[0] // tiles, xp_ref.shape[0]
    T = S - K + 1
    cols = jnp.arange(BC)
    col_in = pl.program_id(2) * BC + cols < width

    def load_rows(ref, at, length, other):
        """Rows ``at [BT]`` of a ``[length]`` or ``[length, BC]`` ref, ``other`` outside ``[0, length)``: indices,
        not ``pl.ds``, since the first block's starts are negative."""
        inside = (at >= 0) & (at < length)
        if len(ref.shape) == 1:
            return pltriton.load(ref.at[at], mask=inside, other=other)
        return pltriton.load(ref.at[at[:, None], cols[None, :]], mask=inside[:, None] & col_in[None, :],
                             other=other).astype(F32)

    def load_cols(ref):  # a [1, BC] or [BC] row
        return pltriton.load(ref, mask=col_in if len(ref.shape) == 1 else col_in[None, :], other=0.0)

    def store(ref, x, mask):
        pltriton.store(ref, x.astype(ref.dtype), mask=mask)

    w = [load_cols(w_ref.at[pl.ds(j, 1), :]) for j in range(K)]  # [1, BC] each
    bias = load_cols(bias_ref)[None, :] if has_bias else None
    first = pl.program_id(1) * tiles * BT  # the program's first row (read outside the loop: interpret mode)

    def tile(it, sums):
        """Row tile ``it`` of this program: its rows of ``dxp`` stored, its outputs' terms added to ``sums`` (``K``
        for ``dw``'s rows, one for ``dbias``, ``[BT, BC]`` each)."""
        s = first + it * BT + jnp.arange(BT)  # this tile's rows of xp
        dxp = jnp.zeros((BT, BC), F32)
        for i in range(K):  # output t = s - i, whose tap i reads row s
            # each output's taps loaded where they are used (rows s-i .. s-i+K-1; cache hits after the first): held
            # for all shifts at once they cost about 20 registers per tile element
            taps = [load_rows(xp_ref, s + j - i, S, 0.0) for j in range(K)]
            keeps = None
            if has_ids:
                own = load_rows(ids_ref, s + K - 1 - i, S, -1)
                keeps = [(load_rows(ids_ref, s + j - i, S, -1) == own)[:, None] for j in range(K)]
                taps = [jnp.where(keep, tap, 0.0) for tap, keep in zip(taps, keeps, strict=True)]
            pre = sum(tap * w[j] for j, tap in enumerate(taps))
            if has_bias:
                pre = pre + bias
            sig = jax.nn.sigmoid(pre)
            dpre = load_rows(dy_ref, s - i, T, 0.0) * sig * (1 + pre * (1 - sig))  # zero where t is outside [0, T)
            g = dpre * w[i]
            dxp = dxp + (g if keeps is None else jnp.where(keeps[i], g, 0.0))
            if i == 0:  # the sums over outputs t = s: each counted by the one tile that holds row s
                sums = [acc + x for acc, x in zip(sums, [*(tap * dpre for tap in taps), dpre], strict=True)]
        store(dxp_ref.at[pl.ds(it * BT, BT), :], dxp, (s < S)[:, None] & col_in[None, :])
        return sums

    # the tiles' terms summed element-wise in the loop (the layout of the tiles), over rows once after it
    zeros = [jnp.zeros((BT, BC), F32)] * (K + 1)
    sums = tile(0, zeros) if tiles == 1 else jax.lax.fori_loop(0, tiles, tile, zeros)
    for j in range(K):
        store(dw_ref.at[pl.ds(j, 1), :], jnp.sum(sums[j], axis=0, keepdims=True), col_in[None, :])
    if has_bias:
        store(dbias_refs[0], jnp.sum(sums[K], axis=0), col_in)
