"""The cross-entropy's softmax gradient over one chunk of logits, in Pallas (Triton lowering), with its XLA form.

For logits ``[C, V]`` (stored in the compute dtype), targets ``[C]`` and per-row weights ``[C]``::

    lse      = log(sum_v exp(logits[c, v]))                                  float32 [C]
    dlogits  = weight[c] * (exp(logits[c, v] - lse[c]) - [v == target[c]])   logits' dtype [C, V]

computed in float32 from the stored logits, ``- onehot`` applied before the rounding (see
``hybrid_jax.train.step.loss``). XLA makes three passes over the logits (the max, the sum of exponentials, then
``dlogits``); the kernel makes two: one program per ``rows`` rows sweeps the vocabulary once with a running max and
sum (online log-sum-exp), then again, from the last tile to the first, to write ``dlogits``: the tiles read last are
the likeliest still in L2, and the loads and stores carry L2 eviction hints to that end (the first sweep's tiles
kept, the second sweep's and ``dlogits`` evicted first). ``dlogits`` is written over the logits
(``input_output_aliases``; a tile is stored only after the second sweep has read it), so the chunk holds one
``[C, V]`` buffer, not two. At the 300M recipe's chunk (4,096 x 128,256 bf16) the logits are 1 GB per pass, so
this is memory traffic, not arithmetic.

The vocabulary need not be a multiple of ``block_v``: the last column tile is masked (``-inf`` in, nothing out).
``impl``: ``auto`` (Pallas on a GPU, else XLA), ``xla`` (and ``naive``: the same XLA form), ``pallas``,
``pallas_interpret``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.registry import pallas_or_xla

F32 = jnp.float32


def softmax_grad(logits: jax.Array, targets: jax.Array, weight: jax.Array, *, impl: str = "auto",
                 config: tuning.CrossEntropyConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``(dlogits [C,V] in logits.dtype, lse [C] float32)`` of ``logits [C,V]``, ``targets [C]`` int in ``[0, V)``,
    ``weight [C]`` float (the loss's weight of each row); ``config``: the current GPU's table entry by default."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1] or weight.shape != logits.shape[:1]:
        raise ValueError(f"softmax_grad: need logits [C,V], targets [C] and weight [C], got {logits.shape}, "
                         f"{targets.shape}, {weight.shape}")
    impl = pallas_or_xla(impl, "softmax_grad")
    if impl == "xla":
        return softmax_grad_reference(logits, targets, weight)
    return _pallas(logits, targets.astype(jnp.int32), weight.astype(F32), config or tuning.cross_entropy_config(),
                   interpret=impl == "pallas_interpret")


def softmax_grad_reference(logits: jax.Array, targets: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The XLA form (and the kernel's reference): the same ``(dlogits, lse)``."""
    x = logits.astype(F32)
    lse = jax.nn.logsumexp(x, axis=-1)
    onehot = jnp.arange(x.shape[-1])[None, :] == targets[:, None]
    dlogits = (jnp.exp(x - lse[:, None]) - onehot) * weight.astype(F32)[:, None]
    return dlogits.astype(logits.dtype), lse


def _pallas(logits: jax.Array, targets: jax.Array, weight: jax.Array, config: tuning.CrossEntropyConfig, *,
            interpret: bool) -> tuple[jax.Array, jax.Array]:
    C, V = logits.shape
    rows = math.gcd(C, config.rows)  # a power of two dividing C: no row masks
    block_v = min(config.block_v, pl.next_power_of_2(V))
    width = pl.cdiv(V, block_v) * block_v  # the block's columns: whole tiles, the last one masked
    kernel = functools.partial(_kernel, vocab=V, block_v=block_v)
    return pl.pallas_call(
        kernel,
        grid=(C // rows,),
        in_specs=[pl.BlockSpec((rows, width), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,)),
                  pl.BlockSpec((rows,), lambda i: (i,))],
        out_specs=[pl.BlockSpec((rows, width), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((C, V), logits.dtype), jax.ShapeDtypeStruct((C,), F32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.launch.num_warps,
                                                num_stages=config.launch.num_stages),
        input_output_aliases={0: 0},  # dlogits over the logits
        interpret=interpret,
        name="cross_entropy_softmax_grad",
    )(logits, targets, weight)


def _kernel(logits_ref, targets_ref, weight_ref, dlogits_ref, lse_ref, *, vocab: int, block_v: int):
    """``logits_ref, dlogits_ref: [rows, width]`` (columns past ``vocab`` masked), ``targets_ref: [rows]`` int32,
    ``weight_ref: [rows]`` float32, ``lse_ref: [rows]`` float32."""
    rows = logits_ref.shape[0]
    full, tail = divmod(vocab, block_v)

    def tile(j, masked: bool, policy: str):
        cols = j * block_v + lax.broadcasted_iota(jnp.int32, (rows, block_v), 1)
        ref = logits_ref.at[:, pl.ds(j * block_v, block_v)]
        x = pltriton.load(ref, mask=cols < vocab if masked else None, other=-jnp.inf if masked else None,
                          eviction_policy=policy)
        return cols, x.astype(F32)

    def stats(j, carry, masked: bool):
        m, s = carry
        _, x = tile(j, masked, "evict_last")
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        return m_new, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)

    carry = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32))
    carry = lax.fori_loop(0, full, functools.partial(stats, masked=False), carry)
    if tail:
        carry = stats(full, carry, masked=True)
    m, s = carry
    lse = m + jnp.log(s)
    target = targets_ref[...]
    weight = weight_ref[...]

    def write(j, masked: bool):
        cols, x = tile(j, masked, "evict_first")
        d = (jnp.exp(x - lse[:, None]) - (cols == target[:, None]).astype(F32)) * weight[:, None]
        pltriton.store(dlogits_ref.at[:, pl.ds(j * block_v, block_v)], d.astype(dlogits_ref.dtype),
                       mask=cols < vocab if masked else None, eviction_policy="evict_first")

    def backwards(i, carry):  # the second sweep from the last tile: the last tiles read are the first read again
        write(full - 1 - i, masked=False)
        return carry

    if tail:
        write(full, masked=True)
    lax.fori_loop(0, full, backwards, 0)
    lse_ref[...] = lse
