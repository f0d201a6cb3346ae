"""The short conv's backward kernel (interpret mode) and its XLA form against autodiff of the conv written out (the
arithmetic ``ShortConv`` had before it had a kernel), at a ragged T and C, with and without a bias and documents, on
a padded ``xp`` and on ``x`` at a sequence's start (``padded=False``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.short_conv import _pallas_backward, short_conv_backward_reference, short_conv_silu
from hybrid_jax.kernels.tooling.lowering import lower

B, T, K = 2, 37, 4


def conv_autodiff(xp, w, bias, same_doc, out_dtype):
    """The plain conv: tap j of output t reads ``xp[t+j]`` (zero where ``same_doc[j]`` is False), SiLU in float32."""
    taps = [xp[:, j : j + T] for j in range(K)]
    if same_doc is not None:
        taps = [jnp.where(keep, tap, 0.0) for tap, keep in zip(taps, same_doc, strict=True)]
    y = sum(tap * w[j] for j, tap in enumerate(taps))
    if bias is not None:
        y = y + bias
    return jax.nn.silu(y).astype(out_dtype)


def inputs(C: int, use_bias: bool, documents: bool, out_dtype):
    kx, kw, kb, kd = jax.random.split(jax.random.key(C), 4)
    xp = 2.0 * jax.random.normal(kx, (B, K - 1 + T, C))
    w = jax.random.normal(kw, (K, C))
    bias = jax.random.normal(kb, (C,)) if use_bias else None
    dy = jax.random.normal(kd, (B, T, C)).astype(out_dtype)
    ids = same_doc = None
    if documents:  # row 0: documents starting at 0, 10 and 11 (one token long); row 1: at 0 and 30
        segment_ids = jnp.asarray([[0] * 10 + [1] + [2] * 26, [5] * 30 + [6] * 7], jnp.int32)
        ids = jnp.pad(segment_ids, ((0, 0), (K - 1, 0)), constant_values=-1)  # as ShortConv pads them
        same_doc = [(ids[:, j : j + T] == segment_ids)[..., None] for j in range(K)]
    return xp, w, bias, ids, same_doc, dy


@pytest.mark.parametrize("C", [48, 100])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("padded", [True, False])
def test_gradients_match_autodiff(C, use_bias, documents, out_dtype, padded):
    """T 37 (K-1+T = 40 rows: two row blocks, the second ragged), C 48 or 100 (ragged channel blocks); bfloat16: the
    output rounded once, the gradients still float32 arithmetic from the same ``dy``. Unpadded: x is xp's last T
    rows, the first K-1 zero in the reference."""
    assert (K - 1 + T) % tuning.ShortConvConfig().rows and C % tuning.ShortConvConfig().channels
    xp, w, bias, ids, same_doc, dy = inputs(C, use_bias, documents, out_dtype)
    if not padded:
        xp, ids = xp[:, K - 1 :], None if ids is None else ids[:, K - 1 :]
    args = (xp, w) if bias is None else (xp, w, bias)
    lead = 0 if padded else K - 1
    want_y, vjp = jax.vjp(lambda xp, w, b=None: conv_autodiff(jnp.pad(xp, ((0, 0), (lead, 0), (0, 0))), w, b,
                                                              same_doc, out_dtype), *args)
    want = vjp(dy)
    tol_y = 1e-5 if out_dtype == jnp.float32 else 8e-3
    for impl in ("pallas_interpret", "xla"):
        y, vjp = jax.vjp(lambda xp, w, b=None, impl=impl: short_conv_silu(xp, w, b, ids, out_dtype=out_dtype,
                                                                           impl=impl, padded=padded), *args)
        assert y.dtype == out_dtype and y.shape == (B, T, C)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32), rtol=tol_y,
                                   atol=tol_y)
        for got, ref in zip(vjp(dy), want, strict=True):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("padded", [True, False])
def test_kernel_matches_its_reference(tiles, padded):
    """The kernel's ``(dxp, dw, dbias)`` against the XLA form at a tile of 16 x 32 (40 rows: three programs of one
    tile, or two of two tiles, the second's first tile ragged and its second past the end); unpadded, x's rows
    after K-1 zero rows of document -1 in the reference."""
    xp, w, bias, ids, _, dy = inputs(48, True, True, jnp.bfloat16)
    config = tuning.ShortConvConfig(rows=16, channels=32, tiles=tiles)
    if padded:
        got = _pallas_backward(dy, xp, w, bias, ids, config, interpret=True)
    else:  # the reference's xp: x after zero rows of document -1
        xp = xp.at[:, : K - 1].set(0.0)
        ids = ids.at[:, : K - 1].set(-1)
        got = _pallas_backward(dy, xp[:, K - 1 :], w, bias, ids[:, K - 1 :], config, interpret=True, lead=K - 1)
    want = list(short_conv_backward_reference(dy, xp, w, bias, ids))
    want[0] = want[0] if padded else want[0][:, K - 1 :]
    for g, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_forward_on_a_gpu_compares_nothing():
    """The forward's SiLU lowered for a GPU holds no comparison: ``jax.nn.silu`` there compares with a zero tensor of
    the activation's shape, which XLA shares with other zeros of that shape and reads from memory in every layer."""
    xp = jax.ShapeDtypeStruct((2, 67, 96), jnp.bfloat16)
    w, bias = jax.ShapeDtypeStruct((4, 96), jnp.float32), jax.ShapeDtypeStruct((96,), jnp.float32)
    text = lower(lambda x, w, b: short_conv_silu(x, w, b, None, out_dtype=jnp.bfloat16, impl="pallas"),
                 (xp, w, bias), "sm90")
    assert "stablehlo.exponential" in text and "stablehlo.compare" not in text


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="need xp"):
        short_conv_silu(jnp.zeros((2, 6, 3)), jnp.zeros((4, 5)), None, None, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"segment_ids \[B, T\]"):
        short_conv_silu(jnp.zeros((2, 6, 3)), jnp.zeros((4, 3)), None, jnp.zeros((2, 9), jnp.int32),
                        out_dtype=jnp.float32, padded=False)
    with pytest.raises(ValueError, match="impl must be one of"):
        short_conv_silu(jnp.zeros((2, 6, 3)), jnp.zeros((4, 3)), None, None, out_dtype=jnp.float32, impl="triton")


@pytest.mark.parametrize("split", [(64, 64, 72), (50, 150)], ids=["whole_blocks", "concatenated"])
def test_split_output_has_the_same_values_and_gradients(split):
    """``split``: y's channel pieces as arrays, the kernel reading their gradients where they lie (pieces of whole
    64-channel blocks, the last ragged) or concatenated (a piece that ends inside a block); unpadded, with ids."""
    xp, w, bias, ids, _, dy = inputs(200, True, True, jnp.bfloat16)
    x, ids = xp[:, K - 1 :], ids[:, K - 1 :]
    dys = tuple(jnp.split(dy, np.cumsum(split)[:-1], axis=-1))
    for impl in ("pallas_interpret", "xla"):
        def conv(x, w, b, split=None, impl=impl):
            return short_conv_silu(x, w, b, ids, out_dtype=jnp.bfloat16, impl=impl, padded=False, split=split)

        want_y, want_vjp = jax.vjp(conv, x, w, bias)
        pieces, vjp = jax.vjp(functools.partial(conv, split=split), x, w, bias)
        assert [p.shape[-1] for p in pieces] == list(split)
        np.testing.assert_array_equal(jnp.concatenate(pieces, axis=-1), want_y)
        for got, ref in zip(vjp(dys), want_vjp(dy), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
