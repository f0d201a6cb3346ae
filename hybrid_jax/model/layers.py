"""Shared building blocks: initialisers, the token lookup, linear layers, RMSNorm (plain and grouped), short causal
conv, SwiGLU MLP.

Conventions (all modules of ``hybrid_jax.model``):

* Parameters are stored in ``param_dtype`` (float32 master weights); activations flow in the compute ``dtype``.
* Linear kernels are ``[in, out]`` (PyTorch's ``weight`` is the transpose), created by :func:`dense`.
* Norms compute in float32 and return the compute dtype.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.kernels.gated_norm import gated_rms_norm
from hybrid_jax.kernels.rms_norm import add_rms_norm, rms_norm
from hybrid_jax.kernels.short_conv import short_conv_silu
from hybrid_jax.kernels.swiglu import swiglu
from hybrid_jax.model.plan import recomputed
from hybrid_jax.parallel.shards import previous_tail

Initializer = nnx.initializers.Initializer
ZEROS = nnx.initializers.zeros_init()
Heads = tuple[tuple[int, int], ...]  # ((heads, head_dim), ...): channel pieces of h * d channels each


# --------------------------------------------------------------------------------------------- initialisers
def normal_init(std: float) -> Initializer:
    """``normal(0, std)``: Megatron's ``init_method_normal`` for every Linear and the embedding."""
    return nnx.initializers.normal(stddev=std)


def torch_default_init(fan_in: int) -> Initializer:
    """PyTorch's default ``nn.Linear`` / ``nn.Conv1d`` init (weight and bias): ``U(+-1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def a_log_init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    """``A_log = log(A)`` with ``A ~ U(1, 16)`` (U(0, 16) can give ``log 0``)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def dt_bias_init(key: jax.Array, shape, dtype=jnp.float32, dt_min: float = 1e-3, dt_max: float = 0.1,
                 dt_floor: float = 1e-4) -> jax.Array:
    """``dt_bias = softplus^-1(dt)``, ``dt = exp(U(log dt_min, log dt_max))`` clamped ``>= dt_floor``."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), dt_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


# --------------------------------------------------------------------------------------------- linear
def dtypes(cfg: ConfigDict) -> tuple[jnp.dtype, jnp.dtype]:
    """``(compute dtype, param dtype)`` of a model config."""
    return jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)


def dense(cfg: ConfigDict, d_in: int, d_out: int, *, rngs: nnx.Rngs, kernel_init: Initializer | None = None,
          use_bias: bool = False, bias_init: Initializer = ZEROS) -> nnx.Linear:
    """A Linear ``[d_in] -> [d_out]`` (kernel ``[d_in, d_out]``), no bias by default, ``normal(init_std)`` init."""
    dtype, param_dtype = dtypes(cfg)
    return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=kernel_init or normal_init(cfg.init_std), bias_init=bias_init, rngs=rngs)


# --------------------------------------------------------------------------------------------- norms
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows of ``table [V, D]`` at integer ``tokens [..., T]``: ``[..., T, D]`` in ``dtype`` (``nnx.Embed``'s values).

    The gradient for ``table`` is in ``table``'s dtype and sums in float32: within each row of ``tokens`` (the last
    axis) the ids are sorted and each id's cotangents summed as one segment, then one scatter-add puts each row's
    sums into ``[V, D]``. The scatter-add that a gather's transpose becomes adds in the cotangents' dtype (bfloat16)
    and serialises its atomic adds on ids that repeat; real text repeats a few ids thousands of times per batch, so
    it made a step on real data slower than on uniform mock tokens. Rows stay whole, so a batch split over devices
    is summed where it lies."""
    return jnp.take(table, tokens, axis=0).astype(dtype)


def _lookup_fwd(table: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, tuple]:
    return lookup(table, tokens, dtype), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))  # V and dtype


def _lookup_bwd(dtype: jnp.dtype, res: tuple, grad: jax.Array) -> tuple[jax.Array, None]:
    tokens, like = res
    vocab, T = like.shape[0], tokens.shape[-1] if tokens.ndim else 1
    ids = tokens.reshape(-1, T)
    rows = grad.reshape(*ids.shape, -1).astype(jnp.float32)
    order = jnp.argsort(ids, axis=-1)
    ids = jnp.take_along_axis(ids, order, axis=-1)  # [R, T], each row sorted
    rows = jnp.take_along_axis(rows, order[..., None], axis=1)
    starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    segment = jnp.cumsum(starts, axis=1) - 1  # [R, T]: the index of each position's id among its row's ids
    sums = jax.vmap(lambda r, s: jax.ops.segment_sum(r, s, num_segments=T, indices_are_sorted=True))(rows, segment)
    first = jnp.where(starts, ids, vocab)
    unique = jax.vmap(lambda f, s: jax.ops.segment_min(f, s, num_segments=T, indices_are_sorted=True))(first, segment)
    summed = jnp.zeros((vocab, rows.shape[-1]), jnp.float32).at[unique.reshape(-1)].add(
        sums.reshape(-1, rows.shape[-1]), mode="drop")  # unused segments hold an id >= vocab: dropped
    return summed.astype(like.dtype), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a weight ``[dim]`` (ones); float32 inside, output in the compute dtype
    (:func:`hybrid_jax.kernels.rms_norm.rms_norm`). :meth:`add` forms the residual stream before it too."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype = jnp.float32,
                 kernel_impl: str = "auto"):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype
        self.kernel_impl = kernel_impl

    def __call__(self, x: jax.Array) -> jax.Array:
        """``rmsnorm(x) * weight``, ``x: [..., dim]``."""
        return rms_norm(x, self.weight[...], eps=self.eps, out_dtype=self.dtype)

    def add(self, x: jax.Array, y: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """``(s, self(s))`` of the stream ``s = x + y`` (``y``: the previous sublayer's output in ``x``'s dtype;
        ``None``: ``s = x``); on a GPU one kernel each way (:func:`hybrid_jax.kernels.rms_norm.add_rms_norm`,
        ``kernel_impl`` as ``model.kernel_impl``)."""
        if y is None:
            return x, self(x)
        return add_rms_norm(x, y, self.weight[...], eps=self.eps, out_dtype=self.dtype, impl=self.kernel_impl)


class GatedRMSNorm(nnx.Module):
    """The mixers' gated RMSNorm with a weight ``[dim]`` (ones), over groups of ``dim // groups`` channels, gate
    ``s = silu(z)`` or ``sigmoid(z)`` (``activation``)::

        gate_first (Mamba2):  rmsnorm_group(y * s) * weight
        otherwise (GDN, KDA): rmsnorm_group(y) * weight * s

    ``y, z: [..., dim]``; float32 inside, output in the compute dtype. It is
    :func:`hybrid_jax.kernels.gated_norm.gated_rms_norm` (its backward one Pallas kernel on a GPU, from the inputs:
    no float32 copy of the activations kept for it; ``kernel_impl`` as ``model.kernel_impl``)."""

    def __init__(self, dim: int, *, groups: int = 1, gate_first: bool = False, activation: str = "silu", eps: float,
                 dtype: jnp.dtype, param_dtype: jnp.dtype = jnp.float32, kernel_impl: str = "auto"):
        if dim % groups:
            raise ValueError(f"GatedRMSNorm: dim {dim} is not a multiple of groups {groups}")
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.groups, self.gate_first, self.activation = groups, gate_first, activation
        self.eps, self.dtype, self.kernel_impl = eps, dtype, kernel_impl

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        return gated_rms_norm(y, z, self.weight[...], groups=self.groups, gate_first=self.gate_first, eps=self.eps,
                              out_dtype=self.dtype, activation=self.activation, impl=self.kernel_impl)


# --------------------------------------------------------------------------------------------- short conv
class ShortConv(nnx.Module):
    """Depthwise causal conv over time, then SiLU: ``y[t, c] = silu(b[c] + sum_j w[j, c] x[t - K + 1 + j, c])``.

    ``kernel: [K, C]`` (PyTorch ``conv1d.weight [C, 1, K]`` is ``kernel.T[:, None, :]``); optional ``bias: [C]``.
    PyTorch's default Conv1d init (``U(+-1/sqrt(K))``) for both. ``x: [B, T, C] -> [B, T, C]``. With packed
    documents (``segment_ids [B, T]``) a tap from another document counts as zero, as the causal padding does at
    a sequence's start. With the time axis split over a context axis (``context``, inside its ``shard_map``) the
    first ``K-1`` taps read the previous shard's last ``K-1`` inputs (a halo, one ``ppermute``). The conv is
    :func:`hybrid_jax.kernels.short_conv.short_conv_silu` (its backward two Pallas kernels on a GPU; ``kernel_impl``
    as ``model.kernel_impl``).
    """

    def __init__(self, channels: int, kernel_size: int, *, use_bias: bool, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs, kernel_impl: str = "auto"):
        init = torch_default_init(kernel_size)
        self.kernel = nnx.Param(init(rngs.params(), (kernel_size, channels), param_dtype))
        self.bias = nnx.Param(init(rngs.params(), (channels,), param_dtype)) if use_bias else None
        self.dtype = dtype
        self.kernel_impl = kernel_impl

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, context: str | None = None,
                 heads: Heads | None = None) -> jax.Array | list[jax.Array]:
        """Sums and SiLU in float32; the result in the compute dtype. ``context``: the mesh axis the time axis is
        split over (``None``: the whole sequence is here, its start the causal padding's zeros, which no array
        holds). ``heads``: ``((h, d), ...)`` with ``sum(h*d) = C``: the output's channel pieces ``[B,T,h,d]``, each
        its own array (no copy splits them, and no concatenation joins their gradients)."""
        K = self.kernel.shape[0]
        if context is not None:
            return self._conv(*context_halo(x, segment_ids, K - 1, context), heads=heads)
        return self._conv(x, segment_ids, padded=False, heads=heads)

    def _conv(self, xp: jax.Array, segment_ids: jax.Array | None = None, *, padded: bool = True,
              heads: Heads | None = None) -> jax.Array | list[jax.Array]:
        """The conv of ``xp: [B, K-1+T, C]`` (the ``K-1`` inputs before the first output, then the inputs;
        ``padded=False``: ``[B, T, C]`` after K-1 zeros); ``segment_ids``: the document of each row of ``xp`` (tap j
        of output t reads ``xp[t+j]``, zero unless in the document of ``xp[t+K-1]``); ``heads`` as ``__call__``."""
        y = short_conv_silu(xp, self.kernel[...], None if self.bias is None else self.bias[...], segment_ids,
                            out_dtype=self.dtype, impl=self.kernel_impl, padded=padded,
                            split=None if heads is None else tuple(h * d for h, d in heads))
        if heads is None:
            return y
        return [p.reshape(*p.shape[:2], h, d) for p, (h, d) in zip(y, heads, strict=True)]

    def init_tail(self, batch: int) -> jax.Array:
        """An empty tail ``[B,K-1,C]`` (zeros, as the causal padding) in the compute dtype."""
        K, C = self.kernel.shape
        return jnp.zeros((batch, K - 1, C), self.dtype)

    def extend(self, x: jax.Array, tail: jax.Array, n: jax.Array, heads: Heads | None = None
               ) -> tuple[jax.Array | list[jax.Array], jax.Array]:
        """Continue a sequence: ``x [B,T,C]`` after the cached ``tail [B,K-1,C]`` (its last ``K-1`` inputs).

        Only the first ``n[b]`` steps of row ``b`` are real; the new tail ends at the last real one.
        Returns ``(y [B,T,C] or its pieces by heads as __call__, new tail [B,K-1,C])``.
        """
        K = self.kernel.shape[0]
        xp = jnp.concatenate([tail.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
        index = n[:, None] + jnp.arange(K - 1)[None, :]  # the K-1 inputs before position n (in xp's coordinates)
        new_tail = jnp.take_along_axis(xp, index[:, :, None], axis=1).astype(tail.dtype)
        return self._conv(xp, heads=heads), new_tail


def context_halo(x: jax.Array, segment_ids: jax.Array | None, n: int, context: str
                 ) -> tuple[jax.Array, jax.Array | None]:
    """``(xp [B, n+T, C], ids [B, n+T])`` for :meth:`ShortConv._conv` on this shard of ``context``: ``x [B,T,C]`` after
    the previous shard's last ``n`` inputs (zeros on shard 0, as the causal padding), and ``segment_ids [B,T]`` after
    theirs (shard 0's padding has document -1); ``None`` without ids."""
    xp = jnp.concatenate([previous_tail(x, n, context), x], axis=1)
    if segment_ids is None:
        return xp, None
    return xp, jnp.concatenate([previous_tail(segment_ids, n, context, fill=-1), segment_ids], axis=1)


# --------------------------------------------------------------------------------------------- MLP
class MLP(nnx.Module):
    """SwiGLU: ``linear_fc2(silu(gate) * up)`` with ``[gate | up] = linear_fc1(x)`` (``D -> 2F -> D``). ``[B,T,D]``.

    ``linear_fc1`` is one ``[D, 2F]`` parameter (Megatron's layout) and one matmul; ``silu(gate) * up`` is
    :func:`hybrid_jax.kernels.swiglu.swiglu` on its output, whose backward (one Pallas kernel on a GPU) writes
    ``d [gate | up]`` whole: the input and weight gradients are then one matmul each over ``2F``."""

    def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
        self.linear_fc1 = dense(cfg, cfg.hidden_size, 2 * cfg.ffn_size, rngs=rngs)
        self.linear_fc2 = dense(cfg, cfg.ffn_size, cfg.hidden_size, rngs=rngs)
        self.kernel_impl = cfg.kernel_impl
        # a recomputed MLP reads [gate | up] again in the backward: SwiGLU's backward must not write over it
        self.overwrite_fc = not recomputed("mlp", cfg)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(swiglu(self.linear_fc1(x), impl=self.kernel_impl, overwrite_fc=self.overwrite_fc))


# --------------------------------------------------------------------------------------------- recurrent helpers
def decay_gate(a_log: jax.Array, a: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """The log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32; ``A_log`` broadcasts over ``a``."""
    return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))


def column_pieces(linear: nnx.Linear, x: jax.Array, widths: tuple[int, ...]) -> list[jax.Array]:
    """``linear(x)`` (no bias) split along its outputs into pieces ``[..., width]`` of ``widths``, each its own
    matmul on a slice of the kernel's columns: each piece's consumer gets an array of its own, so the forward copies
    no slice of the whole output (a kernel's operand must be one) and the backward concatenates no gradients."""
    assert linear.bias is None and sum(widths) == linear.out_features, (linear.out_features, widths)
    bounds = np.cumsum((0, *widths))
    x, kernel = x.astype(linear.dtype), linear.kernel[...].astype(linear.dtype)
    xs = _distinct_copies(x, len(widths))
    return [jnp.dot(xi, kernel[:, a:b], precision=linear.precision)
            for xi, (a, b) in zip(xs, itertools.pairwise(bounds), strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _distinct_copies(x: jax.Array, n: int) -> list[jax.Array]:
    """``n`` names for ``x`` that XLA cannot treat as one (no copy is made): its dot merger would otherwise join
    matmuls of the same ``x`` into one and copy each consumer's slice out of the joined output. The gradient is the
    plain sum: on sm90, where the step is compiled without XLA's Triton GEMMs (``train_step.STEP_XLA_OPTIONS``), it
    rides in a cuBLAS matmul's C operand; with Triton GEMMs XLA fuses it into one's epilogue, but where the GPU
    autotuner then picks cuBLAS for that matmul the add runs as a kernel of its own."""
    return jax.lax.optimization_barrier([x] * n)


def _distinct_fwd(x: jax.Array, n: int) -> tuple[list[jax.Array], None]:
    return _distinct_copies(x, n), None


def _distinct_bwd(n: int, _: None, cts: list[jax.Array]) -> tuple[jax.Array]:
    return (functools.reduce(jnp.add, cts),)


_distinct_copies.defvjp(_distinct_fwd, _distinct_bwd)


def sow(module: nnx.Module, name: str, value: jax.Array) -> None:
    """Record ``value`` as an ``nnx.Intermediate`` named ``name``, only inside ``nnx.capture`` (a no-op elsewhere).

    Capture with ``out, intermediates = nnx.capture(model, nnx.Intermediate)(tokens)``. Outside a capture nothing is
    stored on the module, so jitted training steps never carry (or accumulate) intermediates.
    """
    if _SOW_HAS_CAPTURE_NOOP:
        module.sow(nnx.Intermediate, name, value, capture_noop=True)
    elif hasattr(module, "__captures__"):  # flax < 0.12.12: how Module.sow itself detects an nnx.capture context
        module.sow(nnx.Intermediate, name, value)


_SOW_HAS_CAPTURE_NOOP = "capture_noop" in inspect.signature(nnx.Module.sow).parameters
