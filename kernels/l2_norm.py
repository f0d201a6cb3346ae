"""The delta rules' q/k l2 norm as one Pallas (Triton lowering) kernel each way, where XLA makes a reduction pass and an
element-wise pass each way: forward reads ``x`` and writes ``y``, backward reads ``x`` and ``dy`` and writes ``dx``::

    r = rsqrt(sum(x^2) + eps);   y = x r;   dx = r (dy - y sum(dy y))      float32, stored in x's dtype

over rows of ``K`` channels (masked to the next power of two), tiles of whole rows as the RMSNorm kernels take them
(``tuning.NormConfig``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.row_tiles import sweep_tiles


def l2_norm(x: jax.Array, *, eps: float, interpret: bool = False) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis of ``x [..., K]`` in float32, the result in ``x``'s dtype:
    :func:`hybrid_jax.kernels.reference.l2_normalize` rounded once; differentiable."""
    return _l2(x, float(eps), interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _l2(x, eps, interpret):
    return _l2_call(x, None, eps, interpret)


def _l2_fwd(x, eps, interpret):
    return _l2(x, eps, interpret), x


def _l2_bwd(eps, interpret, x, dy):
    return (_l2_call(x, dy, eps, interpret),)


_l2.defvjp(_l2_fwd, _l2_bwd)


def _l2_call(x: jax.Array, dy: jax.Array | None, eps: float, interpret: bool) -> jax.Array:
    """``y`` (``dy`` None) or ``dx`` from ``dy`` over the rows ``[R, K]`` in ``x``'s dtype, one program per tile of
    ``NormConfig().tile_rows(K)`` rows."""
    config = tuning.NormConfig()
    K = x.shape[-1]
    R = x.size // K
    rows = config.tile_rows(K)
    whole = pl.BlockSpec((R, K), lambda p: (0, 0))
    ins = [x.reshape(R, K)] + ([] if dy is None else [dy.reshape(R, K)])
    out = pl.pallas_call(
        functools.partial(_l2_kernel, n_rows=R, rows=rows, width=pl.next_power_of_2(K), eps=eps),
        grid=(pl.cdiv(R, rows),), in_specs=[whole] * len(ins), out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((R, K), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret, name="l2_norm_fwd" if dy is None else "l2_norm_bwd",
    )(*ins)
    return out.reshape(x.shape)


def _l2_kernel(*refs, n_rows: int, rows: int, width: int, eps: float):
    """``x_ref [R, K]`` (and ``dy_ref [R, K]``: the backward), every row; out ``out_ref [R, K]``, this program's
    tile of ``rows`` rows: ``y = x r`` with ``r = rsqrt(sum(x^2) + eps)``, or ``dx = r (dy - y sum(dy y))``."""
    reads, out_ref = refs[:-1], refs[-1]

    def tile(tiles, store, _):
        x = tiles[0]
        r = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + eps)
        if len(tiles) == 1:
            store(out_ref, x * r)
        else:
            dy = tiles[1]
            store(out_ref, r * (dy - x * r * r * jnp.sum(dy * x, axis=1, keepdims=True)))

    sweep_tiles(tile, None, reads, n_rows=n_rows, rows=rows, per_program=1, width=width, d=reads[0].shape[1])
