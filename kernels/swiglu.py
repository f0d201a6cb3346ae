"""SwiGLU's element-wise part ``silu(gate) * up`` with its backward in one Pallas (Triton lowering) kernel.

Forward (XLA, one fused pass): ``h = silu(gate) * up``. Backward, from ``dh``::

    s = sigmoid(gate);   dup = dh * gate * s;   dgate = dh * up * s * (1 + gate * (1 - s))

XLA computes ``dup`` and ``dgate`` in two passes that each read ``dh`` and ``gate`` (seven tensor-sized reads and
writes at the 300M MLP); the kernel reads ``dh``, ``gate`` and ``up`` once and writes both (five). All arithmetic is
float32, each output rounded once to the inputs' dtype.

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


def swiglu(gate: jax.Array, up: jax.Array, *, impl: str = "auto") -> jax.Array:
    """``silu(gate) * up`` (``gate, up``: one shape and dtype, any rank), differentiable; its backward by ``impl``."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must share shape and dtype, got {gate.dtype}{list(gate.shape)} and "
                         f"{up.dtype}{list(up.shape)}")
    return _swiglu(gate, up, pallas_or_xla(impl, "swiglu"))


def swiglu_backward_reference(dh: jax.Array, gate: jax.Array, up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The XLA form of the backward (and the kernel's reference): ``(dgate, dup)`` in ``gate``'s dtype."""
    g, u, d = gate.astype(F32), up.astype(F32), dh.astype(F32)
    s = jax.nn.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).astype(gate.dtype), (d * g * s).astype(gate.dtype)


def _forward(gate: jax.Array, up: jax.Array) -> jax.Array:
    g = gate.astype(F32)
    return (g * jax.nn.sigmoid(g) * up.astype(F32)).astype(gate.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _swiglu(gate: jax.Array, up: jax.Array, impl: str) -> jax.Array:
    return _forward(gate, up)


def _swiglu_fwd(gate, up, impl):
    return _forward(gate, up), (gate, up)


def _swiglu_bwd(impl, residuals, dh):
    gate, up = residuals
    if impl == "xla":
        return swiglu_backward_reference(dh, gate, up)
    return _pallas_backward(dh.astype(gate.dtype), gate, up, tuning.ElementwiseConfig(),
                            interpret=impl == "pallas_interpret")


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _pallas_backward(dh: jax.Array, gate: jax.Array, up: jax.Array, config: tuning.ElementwiseConfig, *,
                     interpret: bool) -> tuple[jax.Array, jax.Array]:
    """The kernel over the flattened arrays, ``config.block`` elements per program (the last block masked)."""
    shape, n = gate.shape, gate.size
    block = min(config.block, pl.next_power_of_2(n))
    spec = pl.BlockSpec((block,), lambda i: (i,))
    dgate, dup = pl.pallas_call(
        functools.partial(_backward_kernel, n=n),
        grid=(pl.cdiv(n, block),),
        in_specs=[spec, spec, spec],
        out_specs=[spec, spec],
        out_shape=[jax.ShapeDtypeStruct((n,), gate.dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        interpret=interpret,
        name="swiglu_bwd",
    )(dh.reshape(n), gate.reshape(n), up.reshape(n))
    return dgate.reshape(shape), dup.reshape(shape)


def _backward_kernel(dh_ref, gate_ref, up_ref, dgate_ref, dup_ref, *, n: int):
    """Every ref ``[block]``: this program's elements of the flattened tensors; past ``n`` masked."""
    block = gate_ref.shape[0]
    mask = None
    if n % block:
        mask = pl.program_id(0) * block + jnp.arange(block) < n

    def load(ref):
        return (ref[...] if mask is None else pltriton.load(ref, mask=mask, other=0.0)).astype(F32)

    d, g, u = load(dh_ref), load(gate_ref), load(up_ref)
    s = jax.nn.sigmoid(g)
    dgate = (d * u * s * (1 + g * (1 - s))).astype(dgate_ref.dtype)
    dup = (d * g * s).astype(dup_ref.dtype)
    if mask is None:
        dgate_ref[...], dup_ref[...] = dgate, dup
    else:
        pltriton.store(dgate_ref, dgate, mask=mask)
        pltriton.store(dup_ref, dup, mask=mask)
