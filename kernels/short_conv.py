"""The short causal depthwise conv with SiLU (``ShortConv``), its backward in two Pallas (Triton lowering) kernels.

For ``xp [B, K-1+T, C]`` (the ``K-1`` inputs before the first output, then the inputs), ``w [K, C]``, an optional
``bias [C]`` and optional document ids ``segment_ids [B, K-1+T]`` of xp's rows, output ``t`` is::

    keep_j[t] = segment_ids[t+j] == segment_ids[t+K-1]      (True without ids: tap j reads t's document)
    pre[t]    = sum_j keep_j[t] * xp[t+j] * w[j] + bias;    y[t] = silu(pre[t])

Forward: XLA, one fused pass (float32 sums and SiLU, ``y`` rounded once to ``out_dtype``). Backward, from ``dy``,
with ``dpre = dy * silu'(pre)`` (``pre`` recomputed: the residuals are the inputs)::

    dxp[s] = sum_j keep_j[s-j] * dpre[s-j] * w[j]   (t = s-j in [0, T));   dw[j] = sum_{b,t} keep_j[t] xp[t+j] dpre[t]

A sequence's start (``padded=False``) takes ``x [B, T, C]`` and ids ``[B, T]``: xp is x after ``K-1`` zero rows of
no document, which no array holds. The backward's residual is then ``x`` itself (often a matmul's output) and its
gradient ``dx [B, T, C]``: neither a padded copy of x nor a slice of ``dxp`` is written.

XLA writes ``dxp`` as a concatenation of the K shifted terms and ``dw`` as K more reductions over the activations.
The kernels: the first, per tile of outputs, loads the K taps and ``dy`` once, writes ``dpre`` (rounded once to the
activations' dtype) and the tile's partial sums of ``dw`` and ``dbias`` (from its float32 values); the second writes
each tile of ``dxp`` from K shifted reads of ``dpre``.

``impl``: ``auto`` (Pallas on a GPU, else XLA), ``xla`` (and ``naive``), ``pallas``, ``pallas_interpret``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.registry import pallas_or_xla

F32 = jnp.float32


def short_conv_silu(xp: jax.Array, w: jax.Array, bias: jax.Array | None, segment_ids: jax.Array | None, *,
                    out_dtype: jnp.dtype, impl: str = "auto", padded: bool = True,
                    split: tuple[int, ...] | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """``y [B, T, C]`` in ``out_dtype`` of ``xp [B, K-1+T, C]`` (``padded=False``: ``x [B, T, C]``, a sequence's
    start), ``w [K, C]``, ``bias [C]`` or None and ``segment_ids`` of xp's (x's) rows, int or None (see the module's
    formula); differentiable in ``xp``, ``w`` and ``bias`` (gradients in their dtypes), its backward by ``impl``.
    ``split``: channel widths adding up to C; then the tuple of y's pieces ``[B, T, width]``, each its own array
    (the backward's kernel reads their gradients where they lie)."""
    B, S, C = xp.shape
    pieces = (C,) if split is None else tuple(split)
    if sum(pieces) != C or min(pieces) < 1:
        raise ValueError(f"short_conv_silu: split={split} must be positive channel widths adding up to C={C}")
    lead = 0 if padded else w.shape[0] - 1  # zero rows before xp's first, held by no array
    if w.ndim != 2 or w.shape[1] != C or S + lead < w.shape[0] or (bias is not None and bias.shape != (C,)) or (
            segment_ids is not None and segment_ids.shape != (B, S)):
        rows = "K-1+T" if padded else "T"
        raise ValueError(f"short_conv_silu: need xp [B, {rows}, C], w [K, C], bias [C] and segment_ids [B, {rows}], "
                         f"got {xp.shape}, {w.shape}, {None if bias is None else bias.shape} and "
                         f"{None if segment_ids is None else segment_ids.shape}")
    y = _short_conv(xp, w, bias, segment_ids, jnp.dtype(out_dtype), pallas_or_xla(impl, "short_conv_silu"), lead,
                    pieces)
    return y[0] if split is None else y


def _lead_rows(xp: jax.Array, segment_ids: jax.Array | None, lead: int) -> tuple[jax.Array, jax.Array | None]:
    """``xp`` and ``segment_ids`` after ``lead`` zero rows of document -1 (inside XLA's fusions: no copy kept)."""
    if not lead:
        return xp, segment_ids
    xp = jnp.pad(xp, ((0, 0), (lead, 0), (0, 0)))
    return xp, None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (lead, 0)), constant_values=-1)


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
    """``silu(pre)`` as ``pre / (1 + exp(-pre))``. On a GPU ``jax.nn.silu`` compares ``pre`` with a zero tensor of
    its shape; JAX 0.12's XLA shares that tensor with other float32 zeros of the shape and then reads it from memory
    in each layer's conv: in the 300M and 1B GDN and KDA steps (the conv's channels equal the hidden size) the token
    lookup gradient's, 6.4-8.6 GB per step (benchmarks/NOTES.md "short conv backward kernels")."""
    K = w.shape[0]
    pre = _pre(_taps(xp, K, _keeps(segment_ids, K)), w, bias)
    return (pre / (1 + jnp.exp(-pre))).astype(out_dtype)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _short_conv(xp, w, bias, segment_ids, out_dtype: jnp.dtype, impl: str, lead: int, split: tuple[int, ...]
                ) -> tuple[jax.Array, ...]:
    xp, segment_ids = _lead_rows(xp, segment_ids, lead)
    y = _forward(xp, w, bias, segment_ids, out_dtype)
    return tuple(jnp.split(y, np.cumsum(split)[:-1], axis=-1))


def _short_conv_fwd(xp, w, bias, segment_ids, out_dtype, impl, lead, split):
    return _short_conv(xp, w, bias, segment_ids, out_dtype, impl, lead, split), (xp, w, bias, segment_ids)


def _short_conv_bwd(out_dtype, impl, lead, split, residuals, dy):
    xp, w, bias, segment_ids = residuals
    if impl == "xla":
        xp, segment_ids = _lead_rows(xp, segment_ids, lead)
        dy = jnp.concatenate(dy, axis=-1)
        dxp, dw, dbias = short_conv_backward_reference(dy, xp, w, bias, segment_ids)
        dxp = dxp[:, lead:]
    else:
        dxp, dw, dbias = _pallas_backward(dy, xp, w, bias, segment_ids, tuning.ShortConvConfig(),
                                          interpret=impl == "pallas_interpret", lead=lead)
    return dxp, dw.astype(w.dtype), None if bias is None else dbias.astype(bias.dtype), None


_short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)


def _pallas_backward(dy: jax.Array | Sequence[jax.Array], xp: jax.Array, w: jax.Array, bias: jax.Array | None,
                     segment_ids: jax.Array | None, config: tuning.ShortConvConfig, *, interpret: bool,
                     lead: int = 0) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The reference's ``(dxp, dw, dbias)`` in two kernels over ``rows x channels`` tiles: the first computes
    ``dpre [B, T, C]`` (in xp's dtype) once per output with each program's partial sums of ``dw`` and ``dbias`` (grid
    ``(B, output row blocks of config.tiles tiles, channel blocks)``; XLA adds the partial sums up), the second
    ``dxp`` from K shifted reads of ``dpre`` (grid ``(B, xp row tiles, channel blocks)``). ``lead``: zero rows before
    ``xp``'s first (``K-1`` at a sequence's start, 0: xp holds them); ``dxp`` has xp's rows. ``dy``: one array or
    its pieces along the channels (those before the last whole channel blocks, else they are concatenated)."""
    B, S, C = xp.shape
    dys = list(dy) if isinstance(dy, (list, tuple)) else [dy]
    K, T = w.shape[0], dys[0].shape[1]
    assert S + lead == K - 1 + T, (S, lead, K, T)
    rows, channels = min(config.rows, pl.next_power_of_2(S)), min(config.channels, pl.next_power_of_2(C))
    if any(d.shape[-1] % channels for d in dys[:-1]):
        dys = [jnp.concatenate(dys, axis=-1)]
    starts = tuple(int(s) for s in np.cumsum([0] + [d.shape[-1] // channels for d in dys[:-1]]))  # first blocks
    tiles = min(config.tiles, pl.cdiv(T, rows))  # row tiles per program of the first kernel
    params = pltriton.CompilerParams(num_warps=config.launch.num_warps, num_stages=config.launch.num_stages)
    ids = None if segment_ids is None else segment_ids.astype(jnp.int32)

    def sequence(length):  # a [length, channels] slab of a [B, length, C] tensor: the kernels load shifted rows
        return pl.BlockSpec((None, length, channels), lambda b, r, c: (b, 0, c))

    def piece(start, width):  # dy's piece from channel block `start` on: its block of this program's channels
        last = pl.cdiv(width, channels) - 1
        return pl.BlockSpec((None, T, channels), lambda b, r, c: (b, 0, jnp.clip(c - start, 0, last)))

    def side_inputs(with_bias):  # (arrays, specs) of w [K, C], bias [C] (with_bias) and ids [B, S] (with documents)
        arrays, specs = [w.astype(F32)], [pl.BlockSpec((K, channels), lambda b, r, c: (0, c))]
        if with_bias:
            arrays.append(bias.astype(F32))
            specs.append(pl.BlockSpec((channels,), lambda b, r, c: (c,)))
        if ids is not None:
            arrays.append(ids)
            specs.append(pl.BlockSpec((None, S), lambda b, r, c: (b, 0)))
        return arrays, specs

    blocks = pl.cdiv(T, rows * tiles)
    arrays, specs = side_inputs(bias is not None)
    out_shape = [jax.ShapeDtypeStruct((B, T, C), xp.dtype), jax.ShapeDtypeStruct((B, blocks, K, C), F32)]
    out_specs = [pl.BlockSpec((None, rows * tiles, channels), lambda b, r, c: (b, r, c)),
                 pl.BlockSpec((None, None, K, channels), lambda b, r, c: (b, r, 0, c))]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((B, blocks, C), F32))
        out_specs.append(pl.BlockSpec((None, None, channels), lambda b, r, c: (b, r, c)))
    dpre, dw, *dbias = pl.pallas_call(
        functools.partial(_dpre_kernel, width=C, tiles=tiles, lead=lead, starts=starts, has_bias=bias is not None,
                          has_ids=ids is not None),
        grid=(B, blocks, pl.cdiv(C, channels)),
        in_specs=[*(piece(s, d.shape[-1]) for s, d in zip(starts, dys, strict=True)), sequence(S), *specs],
        out_specs=out_specs, out_shape=out_shape, compiler_params=params, interpret=interpret,
        name="short_conv_bwd_dpre",
    )(*dys, xp, *arrays)
    arrays, specs = side_inputs(False)
    dxp = pl.pallas_call(
        functools.partial(_dxp_kernel, width=C, lead=lead, has_ids=ids is not None),
        grid=(B, pl.cdiv(S, rows), pl.cdiv(C, channels)), in_specs=[sequence(T), *specs],
        out_specs=pl.BlockSpec((None, rows, channels), lambda b, r, c: (b, r, c)),
        out_shape=jax.ShapeDtypeStruct((B, S, C), xp.dtype), compiler_params=params, interpret=interpret,
        name="short_conv_bwd_dxp",
    )(dpre, *arrays)
    return dxp, jnp.sum(dw, axis=(0, 1)), jnp.sum(dbias[0], axis=(0, 1)) if dbias else None


def _loaders(width: int, BC: int):
    """``(load_rows, load_cols, col_in)`` for a program of channel block ``pl.program_id(2)`` of ``BC`` columns:
    ``load_rows(ref, at [BT], length, other)`` reads rows ``at`` of a ``[length]`` or ``[length, BC]`` ref (``other``
    outside ``[0, length)`` and past column ``width``; indices, not ``pl.ds``, since shifted starts can be negative;
    float32), ``load_cols(ref)`` a ``[1, BC]`` or ``[BC]`` row, ``col_in [BC]`` the columns inside ``width``."""
    cols = jnp.arange(BC)
    col_in = pl.program_id(2) * BC + cols < width

    def load_rows(ref, at, length, other):
        inside = (at >= 0) & (at < length)
        if len(ref.shape) == 1:
            return pltriton.load(ref.at[at], mask=inside, other=other)
        return pltriton.load(ref.at[at[:, None], cols[None, :]], mask=inside[:, None] & col_in[None, :],
                             other=other).astype(F32)

    def load_cols(ref):
        return pltriton.load(ref, mask=col_in if len(ref.shape) == 1 else col_in[None, :], other=0.0)

    return load_rows, load_cols, col_in


def _store(ref, x, mask):
    pltriton.store(ref, x.astype(ref.dtype), mask=mask)


def _dpre_kernel(*refs, width: int, tiles: int, lead: int, starts: tuple[int, ...], has_bias: bool, has_ids: bool):
    """``dy_refs [T, BC]`` (dy's dtype: one per piece of dy, the piece from channel block ``starts[i]`` on; the
    program reads the one its channel block is in), ``xp_ref [S, BC]``, ``w_ref [K, BC]`` float32, ``bias_ref [BC]``
    (with a bias), ``ids_ref [S]`` int32 (with ids): this channel block's whole sequence; out ``dpre_ref [tiles * BT,
    BC]`` in xp's dtype (this program's outputs, ``tiles`` tiles of ``BT`` rows in turn; zero past T),
    ``dw_ref [K, BC]`` and ``dbias_ref [BC]`` (with a bias): sums over its outputs. ``lead + S = K-1+T`` (``lead``
    zero rows of no document before xp's first), float32 arithmetic."""
    dy_refs, (xp_ref, w_ref, *refs) = refs[: len(starts)], refs[len(starts) :]
    bias_ref = refs.pop(0) if has_bias else None
    ids_ref = refs.pop(0) if has_ids else None
    dpre_ref, dw_ref, *dbias_refs = refs
    K, BC = w_ref.shape
    BT, S = dpre_ref.shape[0] // tiles, xp_ref.shape[0]
    T = lead + S - K + 1
    load_rows, load_cols, col_in = _loaders(width, BC)
    w = [load_cols(w_ref.at[pl.ds(j, 1), :]) for j in range(K)]  # [1, BC] each
    bias = load_cols(bias_ref)[None, :] if has_bias else None
    first = pl.program_id(1) * tiles * BT  # the program's first output (read outside the loop: interpret mode)
    piece = sum((pl.program_id(2) >= s).astype(jnp.int32) for s in starts[1:]) if len(starts) > 1 else 0

    def tile(it, sums):
        """Output tile ``it``: its ``dpre`` stored, its terms added to ``sums`` (``K`` for ``dw``'s rows, one for
        ``dbias``, ``[BT, BC]`` each)."""
        t = first + it * BT + jnp.arange(BT)
        r = t - lead  # xp's row of tap 0
        taps = [load_rows(xp_ref, r + j, S, 0.0) for j in range(K)]
        if has_ids:
            own = load_rows(ids_ref, r + K - 1, S, -1)
            taps = [tap if j == K - 1 else jnp.where((load_rows(ids_ref, r + j, S, -1) == own)[:, None], tap, 0.0)
                    for j, tap in enumerate(taps)]
        pre = sum(tap * w[j] for j, tap in enumerate(taps))
        if has_bias:
            pre = pre + bias
        sig = jax.nn.sigmoid(pre)
        dy = jax.lax.switch(piece, [functools.partial(load_rows, ref, t, T, 0.0) for ref in dy_refs])
        dpre = dy * sig * (1 + pre * (1 - sig))  # zero past T
        _store(dpre_ref.at[pl.ds(it * BT, BT), :], dpre, (t < T)[:, None] & col_in[None, :])
        return [acc + x for acc, x in zip(sums, [*(tap * dpre for tap in taps), dpre], strict=True)]

    # the tiles' terms summed element-wise in the loop (the layout of the tiles), over rows once after it
    zeros = [jnp.zeros((BT, BC), F32)] * (K + 1)
    sums = tile(0, zeros) if tiles == 1 else jax.lax.fori_loop(0, tiles, tile, zeros)
    for j in range(K):
        _store(dw_ref.at[pl.ds(j, 1), :], jnp.sum(sums[j], axis=0, keepdims=True), col_in[None, :])
    if has_bias:
        _store(dbias_refs[0], jnp.sum(sums[K], axis=0), col_in)


def _dxp_kernel(*refs, width: int, lead: int, has_ids: bool):
    """``dpre_ref [T, BC]`` in xp's dtype (this channel block's outputs), ``w_ref [K, BC]`` float32, ``ids_ref [S]``
    int32 (with ids); out ``dxp_ref [BT, BC]``: rows ``s`` of this tile, ``sum_i keep_i[t] * dpre[t] * w[i]`` over the
    outputs ``t = lead + s - i`` that read row s as their tap i."""
    dpre_ref, w_ref, *refs = refs
    ids_ref = refs.pop(0) if has_ids else None
    (dxp_ref,) = refs
    K, BC = w_ref.shape
    BT, T = dxp_ref.shape[0], dpre_ref.shape[0]
    S = T + K - 1 - lead
    load_rows, load_cols, col_in = _loaders(width, BC)
    s = pl.program_id(1) * BT + jnp.arange(BT)
    own = load_rows(ids_ref, s, S, -1) if has_ids else None
    dxp = jnp.zeros((BT, BC), F32)
    for i in range(K):  # output t = lead+s-i reads row s as its tap i: in its document if ids[s] == ids[s-i+K-1]
        g = load_rows(dpre_ref, lead + s - i, T, 0.0) * load_cols(w_ref.at[pl.ds(i, 1), :])
        if has_ids and i < K - 1:
            g = jnp.where((load_rows(ids_ref, s - i + K - 1, S, -1) == own)[:, None], g, 0.0)
        dxp = dxp + g
    _store(dxp_ref, dxp, (s < S)[:, None] & col_in[None, :])
