"""SwiGLU's element-wise part ``silu(gate) * up`` on the MLP's first projection ``fc = [gate | up]``, with its
backward in one Pallas (Triton lowering) kernel that writes ``d fc`` whole.

The MLP computes ``fc = x @ W1`` as one matmul (``[..., D] -> [..., 2F]``), so that its backward is one matmul for the
input gradient (``d fc @ W1^T``, contracting over ``2F``) and one for the weight's. Forward (XLA, one fused pass over
the halves): ``h = silu(gate) * up``. Backward, from ``dh``::

    s = sigmoid(gate);   dup = dh * gate * s;   dgate = dh * up * s * (1 + gate * (1 - s))

The kernel reads ``dh`` and both halves of ``fc`` once and writes ``d fc = [dgate | dup]`` in place of a concatenate:
each program takes ``rows x cols`` of each half, ``fc`` seen as ``[N, 2, F]`` (a free reshape). ``d fc`` is written
over ``fc`` (``input_output_aliases``; each tile is read before it is stored), so the backward adds no buffer of the
MLP's widest activation, unless the MLP is recomputed (``overwrite_fc=False``: its recomputed ``h`` reads ``fc`` in
the backward too, and XLA would copy ``fc`` first). All arithmetic is float32, each output rounded once to the inputs'
dtype.

``impl``: ``auto`` (Pallas on a GPU, else XLA), ``xla`` (and ``naive``), ``pallas``, ``pallas_interpret``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.registry import pallas_or_xla

F32 = jnp.float32


def swiglu(fc: jax.Array, *, impl: str = "auto", overwrite_fc: bool = True) -> jax.Array:
    """``silu(gate) * up`` with ``[gate | up] = fc`` split on the last axis (``fc: [..., 2F]`` -> ``[..., F]``),
    differentiable; its backward by ``impl``. ``overwrite_fc``: the Pallas backward writes ``d fc`` over ``fc``; pass
    False where something else reads ``fc`` during the backward (a recomputed MLP recomputes ``h`` from it there), or
    XLA copies ``fc`` for the kernel."""
    if fc.ndim < 1 or fc.shape[-1] % 2:
        raise ValueError(f"swiglu: fc's last axis must hold [gate | up] (an even size), got {fc.dtype}"
                         f"{list(fc.shape)}")
    return _swiglu(fc, pallas_or_xla(impl, "swiglu"), overwrite_fc)


def _halves(fc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(gate, up)`` in float32."""
    gate, up = jnp.split(fc.astype(F32), 2, axis=-1)
    return gate, up


def _gradients(d: jax.Array, g: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(dgate, dup)`` in float32 of float32 ``dh``, ``gate`` and ``up`` (the module's formula)."""
    s = jax.nn.sigmoid(g)
    return d * u * s * (1 + g * (1 - s)), d * g * s


def swiglu_backward_reference(dh: jax.Array, fc: jax.Array) -> jax.Array:
    """The XLA form of the backward (and the kernel's reference): ``d fc = [dgate | dup]`` in ``fc``'s dtype."""
    return jnp.concatenate(_gradients(dh.astype(F32), *_halves(fc)), axis=-1).astype(fc.dtype)


def _forward(fc: jax.Array) -> jax.Array:
    g, u = _halves(fc)
    return (g * jax.nn.sigmoid(g) * u).astype(fc.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _swiglu(fc: jax.Array, impl: str, overwrite_fc: bool) -> jax.Array:
    return _forward(fc)


def _swiglu_fwd(fc, impl, overwrite_fc):
    return _forward(fc), fc


def _swiglu_bwd(impl, overwrite_fc, fc, dh):
    if impl == "xla":
        return (swiglu_backward_reference(dh, fc),)
    return (_pallas_backward(dh.astype(fc.dtype), fc, tuning.ElementwiseConfig(), overwrite_fc=overwrite_fc,
                             interpret=impl == "pallas_interpret"),)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return math.gcd(n, 1 << (max(cap, 1).bit_length() - 1))


def _pallas_backward(dh: jax.Array, fc: jax.Array, config: tuning.ElementwiseConfig, *, overwrite_fc: bool,
                     interpret: bool) -> jax.Array:
    """The kernel over ``fc`` seen as ``[N, 2, F]`` and ``dh`` as ``[N, F]``: each program one ``[rows, cols]`` tile
    of each half, about ``config.block`` elements (``cols`` and ``rows`` powers of two dividing ``F`` and ``N``, so
    no tile is partial); ``d fc`` over ``fc`` with ``overwrite_fc``."""
    shape, f = fc.shape, fc.shape[-1] // 2
    n = math.prod(shape[:-1])
    cols = _pow2_divisor(f, config.block)
    rows = _pow2_divisor(n, config.block // cols)
    dfc = pl.pallas_call(
        _backward_kernel,
        grid=(n // rows, f // cols),
        in_specs=[pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
                  pl.BlockSpec((rows, 2, cols), lambda i, j: (i, 0, j))],
        out_specs=pl.BlockSpec((rows, 2, cols), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n, 2, f), fc.dtype),
        input_output_aliases={1: 0} if overwrite_fc else {},  # d[gate | up] over [gate | up]
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret,
        name="swiglu_bwd",
    )(dh.reshape(n, f), fc.reshape(n, 2, f))
    return dfc.reshape(shape)


def _backward_kernel(dh_ref, fc_ref, dfc_ref):
    """``dh_ref [rows, cols]``; ``fc_ref``, ``dfc_ref [rows, 2, cols]``: this tile of ``gate`` (``[:, 0]``) and ``up``
    (``[:, 1]``), and of their gradients."""
    dgate, dup = _gradients(dh_ref[...].astype(F32), fc_ref[:, 0, :].astype(F32), fc_ref[:, 1, :].astype(F32))
    dfc_ref[:, 0, :] = dgate.astype(dfc_ref.dtype)
    dfc_ref[:, 1, :] = dup.astype(dfc_ref.dtype)
