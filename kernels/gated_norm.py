"""The mixers' gated RMSNorm over groups of channels, its backward in one Pallas (Triton lowering) kernel.

For ``x, z [..., G*d]`` (rows of ``G`` groups of ``d`` channels), ``w`` of ``G*d`` or ``d`` channels (shared by
the groups) and the gate ``s = silu(z)`` (Mamba2, GDN) or ``sigmoid(z)`` (KDA), per group::

    gate first (Mamba2's norm):  u = x * s;   out = u * rsqrt(mean(u^2) + eps) * w
    gate after (GDN's, KDA's):   u = x;       out = u * rsqrt(mean(u^2) + eps) * w * s

Forward: one kernel over tiles of group rows (float32 arithmetic, ``out`` rounded once to ``out_dtype``); XLA's
form, on a CPU, writes ``u`` in float32 for the row means and reads it back. The residuals are the inputs: XLA's own
autodiff keeps a float32 copy of ``u`` or of the normalised rows for the backward, the size of ``x`` in float32 per
layer. Backward, from ``dout``, with ``n = u * r`` (``r`` recomputed per group row)::

    g  = dout * w (* s, gate after);   du = r * (g - n * mean(g * n))
    dx = du (* s, gate first);        ds = du * x (gate first) or dout * n * w (gate after)
    dz = ds * s'(z);   dw = sum over rows of dout * n (* s, gate after)

XLA computes these in three fusions (the Mamba2 profile); the kernel reads ``x``, ``z`` and ``dout`` once and writes
``dx`` and ``dz``; its programs add ``dw``'s terms over the rows they take and XLA adds the programs' sums. A weight
per channel over a number of groups that is not a power of two takes the XLA form (a tile's rows hold whole sets of
the weight's groups). On the H200 the kernel keeps the training step's speed and lowers the 300M Mamba2 hybrid's peak
memory by 1.7 GiB (benchmarks/RESULTS.md).

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
from hybrid_jax.kernels.row_tiles import load_rows, store_rows, sweep_tiles

F32 = jnp.float32
ACTIVATIONS = ("silu", "sigmoid")


def _gate(z: jax.Array, silu: bool) -> tuple[jax.Array, jax.Array]:
    """``(s, ds/dz)`` of float32 ``z``."""
    sig = jax.nn.sigmoid(z)
    if silu:
        return z * sig, sig * (1 + z * (1 - sig))
    return sig, sig * (1 - sig)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, *, groups: int, gate_first: bool, eps: float,
                   out_dtype: jnp.dtype, activation: str = "silu", impl: str = "auto") -> jax.Array:
    """``out [..., D]`` in ``out_dtype`` of ``x, z [..., D]`` (``D = groups * d``) and ``w [D]`` or ``[d]`` (see the
    module's formula; ``activation``: ``silu`` or ``sigmoid``); differentiable in ``x``, ``z`` and ``w`` (gradients
    in their dtypes), backward by ``impl``."""
    D = x.shape[-1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_rms_norm: activation must be one of {' | '.join(ACTIVATIONS)}, got {activation!r}")
    if z.shape != x.shape or D % groups or w.shape not in ((D,), (D // groups,)):
        raise ValueError(f"gated_rms_norm: need x, z [..., D] with D a multiple of groups={groups} and w [D] or "
                         f"[D/groups], got {x.shape}, {z.shape} and {w.shape}")
    return _norm(x, z, w, (groups, gate_first, activation == "silu", float(eps)), jnp.dtype(out_dtype),
                 pallas_or_xla(impl, "gated_rms_norm"))


def _rows(a: jax.Array, d: int) -> jax.Array:
    """``a [..., G*d]`` as float32 group rows ``[R, d]``."""
    return a.reshape(-1, d).astype(F32)


def _weights(w: jax.Array, d: int, rows: int) -> jax.Array:
    """``w`` as ``[rows, d]`` float32: row ``i`` is the weight of group row ``i`` (``rows`` a multiple of the groups
    ``w`` covers)."""
    w = w.reshape(-1, d).astype(F32)
    return jnp.tile(w, (rows // w.shape[0], 1))


def _normalized(x: jax.Array, z: jax.Array, w: jax.Array, d: int, gate_first: bool, silu: bool, eps: float
                ) -> jax.Array:
    """The module's ``out`` in float32 of float32 group rows ``x, z [..., width]`` (columns past ``d`` zero) and
    ``w`` broadcasting against them: the XLA form's and the forward kernel's arithmetic."""
    s = _gate(z, silu)[0]
    u = x * s if gate_first else x
    out = u * jax.lax.rsqrt(jnp.sum(u * u, axis=-1, keepdims=True) / d + eps) * w
    return out if gate_first else out * s


def _forward(x, z, w, form, out_dtype):
    groups, gate_first, silu, eps = form
    d = x.shape[-1] // groups
    x_, z_ = (_rows(a, d).reshape(-1, groups, d) for a in (x, z))
    out = _normalized(x_, z_, w.reshape(-1, d).astype(F32), d, gate_first, silu, eps)
    return out.reshape(x.shape).astype(out_dtype)


def gated_rms_norm_backward_reference(dout: jax.Array, x: jax.Array, z: jax.Array, w: jax.Array, *, groups: int,
                                      gate_first: bool, eps: float, activation: str = "silu"
                                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dx, dz, dw)`` in float32 by the module's formula (the XLA backward and the kernel's reference)."""
    d = x.shape[-1] // groups
    shape = (-1, groups, d)
    x_, z_, do = (_rows(a, d).reshape(shape) for a in (x, z, dout))
    s, ds_dz = _gate(z_, activation == "silu")
    wr = w.reshape(-1, d).astype(F32)  # [G or 1, d]
    u = x_ * s if gate_first else x_
    r = jax.lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + eps)
    n = u * r
    g = do * wr if gate_first else do * wr * s
    du = r * (g - n * jnp.mean(g * n, axis=-1, keepdims=True))
    dx = du * s if gate_first else du
    ds = du * x_ if gate_first else do * n * wr
    dw = jnp.sum(do * n if gate_first else do * n * s, axis=0)  # [G, d]
    if wr.shape[0] == 1:
        dw = jnp.sum(dw, axis=0)
    return dx.reshape(x.shape), (ds * ds_dz).reshape(z.shape), dw.reshape(w.shape)


def _by_kernel(x: jax.Array, w: jax.Array, groups: int, impl: str) -> bool:
    """Whether ``impl`` takes the Pallas kernels: a tile's rows (a power of two) must hold whole sets of the groups
    ``w`` covers (1: shared, or groups)."""
    wg = w.shape[0] * groups // x.shape[-1]
    return impl != "xla" and not wg & (wg - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, z, w, form, out_dtype, impl):
    if _by_kernel(x, w, form[0], impl):
        return _pallas_forward(x, z, w, form, out_dtype, tuning.NormConfig(),
                               interpret=impl == "pallas_interpret")
    return _forward(x, z, w, form, out_dtype)


def _norm_fwd(x, z, w, form, out_dtype, impl):
    return _norm(x, z, w, form, out_dtype, impl), (x, z, w)


def _norm_bwd(form, out_dtype, impl, residuals, dout):
    x, z, w = residuals
    groups, gate_first, silu, eps = form
    if not _by_kernel(x, w, groups, impl):
        dx, dz, dw = gated_rms_norm_backward_reference(dout, x, z, w, groups=groups, gate_first=gate_first, eps=eps,
                                                       activation="silu" if silu else "sigmoid")
    else:
        dx, dz, dw = _pallas_backward(dout, x, z, w, form, tuning.NormConfig(),
                                      interpret=impl == "pallas_interpret")
    return dx.astype(x.dtype), dz.astype(z.dtype), dw.astype(w.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def _pallas_forward(x: jax.Array, z: jax.Array, w: jax.Array, form: tuple, out_dtype: jnp.dtype,
                    config: tuning.NormConfig, *, interpret: bool) -> jax.Array:
    """The module's ``out`` over the group rows ``[R, d]``, one program per tile of rows (``config.tile_rows``)."""
    groups, gate_first, silu, eps = form
    d = x.shape[-1] // groups
    R, wg = x.size // d, w.shape[0] // d
    rows = config.tile_rows(d, wg)
    whole = pl.BlockSpec((R, d), lambda p: (0, 0))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, n_rows=R, width=pl.next_power_of_2(d), gate_first=gate_first, silu=silu,
                          eps=eps),
        grid=(pl.cdiv(R, rows),), in_specs=[whole, whole, pl.BlockSpec((rows, d), lambda p: (0, 0))],
        out_specs=whole, out_shape=jax.ShapeDtypeStruct((R, d), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret, name="gated_rms_norm_fwd",
    )(x.reshape(R, d), z.reshape(R, d), _weights(w, d, rows))
    return out.reshape(x.shape)


def _forward_kernel(x_ref, z_ref, w_ref, out_ref, *, n_rows: int, width: int, gate_first: bool, silu: bool,
                    eps: float):
    """``x_ref, z_ref [R, d]`` (every group row), ``w_ref [BR, d]`` float32 (the weight of each row of a tile); out
    ``out_ref [R, d]``, this program's tile of ``BR`` rows (rows past ``R`` and columns past ``d`` masked)."""
    BR, d = w_ref.shape
    w = load_rows(w_ref, width)

    def tile(xz, store, _):
        store(out_ref, _normalized(*xz, w, d, gate_first, silu, eps))

    sweep_tiles(tile, None, (x_ref, z_ref), n_rows=n_rows, rows=BR, per_program=1, width=width, d=d)


def _pallas_backward(dout: jax.Array, x: jax.Array, z: jax.Array, w: jax.Array, form: tuple,
                     config: tuning.NormConfig, *, interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The reference's ``(dx, dz, dw)`` over the group rows ``[R, d]``: at most ``config.programs`` programs, each
    taking its share of the tiles of about ``config.block`` elements (rows: a power of two, at least the weight's
    groups, a power of two too: :func:`_norm_bwd`) in turn and writing its partial sums of ``dw`` (``[programs,
    rows, d]``; XLA adds them up and folds them onto ``w``)."""
    groups, gate_first, silu, eps = form
    d = x.shape[-1] // groups
    R, wg = x.size // d, w.shape[0] // d  # group rows; the groups w covers (1: shared)
    width = pl.next_power_of_2(d)
    rows = config.tile_rows(d, wg)
    programs, per_program = config.backward_programs(pl.cdiv(R, rows))
    whole = pl.BlockSpec((R, d), lambda p: (0, 0))
    dx, dz, dw = pl.pallas_call(
        functools.partial(_backward_kernel, n_rows=R, per_program=per_program, width=width,
                          gate_first=gate_first, silu=silu, eps=eps),
        grid=(programs,), in_specs=[whole, whole, whole, pl.BlockSpec((rows, d), lambda p: (0, 0))],
        out_specs=[whole, whole, pl.BlockSpec((None, rows, d), lambda p: (p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((R, d), x.dtype), jax.ShapeDtypeStruct((R, d), z.dtype),
                   jax.ShapeDtypeStruct((programs, rows, d), F32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret, name="gated_rms_norm_bwd",
    )(dout.reshape(R, d), x.reshape(R, d), z.reshape(R, d), _weights(w, d, rows))
    dw = jnp.sum(dw, axis=0).reshape(-1, wg, d).sum(0)  # the programs' sums, then the tile's copies of each group
    return dx.reshape(x.shape), dz.reshape(z.shape), dw.reshape(w.shape)


def _backward_kernel(dout_ref, x_ref, z_ref, w_ref, dx_ref, dz_ref, dw_ref, *, n_rows: int, per_program: int,
                     width: int, gate_first: bool, silu: bool, eps: float):
    """``dout_ref, x_ref, z_ref [R, d]`` (every group row), ``w_ref [BR, d]`` float32 (the weight of each row of a
    tile); out ``dx_ref, dz_ref [R, d]`` (this program's tiles written) and ``dw_ref [BR, d]`` float32 (dw's terms
    summed over this program's tiles, per row of a tile), the tiles of ``BR`` rows taken as
    :func:`~hybrid_jax.kernels.rms_norm.sweep_tiles` does."""
    BR, d = w_ref.shape
    w = load_rows(w_ref, width)

    def tile(tiles, store, acc):
        do, x, z = tiles
        s, ds_dz = _gate(z, silu)
        u = x * s if gate_first else x
        r = jax.lax.rsqrt(jnp.sum(u * u, axis=1, keepdims=True) / d + eps)
        n = u * r
        g = do * w if gate_first else do * w * s
        du = r * (g - n * (jnp.sum(g * n, axis=1, keepdims=True) / d))
        store(dx_ref, du * s if gate_first else du)
        store(dz_ref, (du * x if gate_first else do * n * w) * ds_dz)
        return acc + (do * n if gate_first else do * n * s)

    acc = sweep_tiles(tile, jnp.zeros((BR, width), F32), (dout_ref, x_ref, z_ref), n_rows=n_rows, rows=BR,
                      per_program=per_program, width=width, d=d)
    store_rows(dw_ref, acc)
