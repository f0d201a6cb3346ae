"""The Pallas flash attention (``kernels/flash_attention.py``, interpreted on CPU) equals the float32 softmax reference:
values and gradients, ragged T, qk head dim != v head dim, bf16 and float32, causal and not, packed documents; plus
the impl choice and cuDNN padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import kernels
from hybrid_jax.kernels import cudnn_attention as cudnn
from hybrid_jax.kernels import flash_attention as flash
from hybrid_jax.kernels import reference, tuning
from hybrid_jax.kernels.tooling.errors import Tolerance
from hybrid_jax.kernels.tooling.problems import Problem
from tests.kernels.conftest import check, make_inputs, rel_rms, segment_ids

# Several blocks per sequence, a different tiling in each kernel (exercises the padded row statistics).
SMALL = tuning.AttentionConfig(
    fwd=tuning.AttentionKernel(32, 16),
    dkdv=tuning.AttentionKernel(16, 32),
    dq=tuning.AttentionKernel(64, 16),
)


def attention(B: int, T: int, H: int, dqk: int, dv: int, dtype: str = "float32", scale: float | None = None):
    return Problem("attention", B, T, H, H, dqk, dv, dtype, scale=scale)


CASES = [  # T, Dqk, Dv, dtype, causal, scale, config
    pytest.param(37, 48, 32, "float32", True, None, None, id="T37-qk48-v32-f32-causal"),
    pytest.param(100, 48, 32, "float32", False, None, SMALL, id="T100-qk48-v32-f32-full-blocks"),
    pytest.param(100, 64, 64, "bfloat16", True, None, SMALL, id="T100-qk64-v64-bf16-causal-blocks"),
    pytest.param(128, 32, 16, "float32", True, 0.3, SMALL, id="T128-qk32-v16-f32-causal-scale"),
    pytest.param(37, 48, 32, "bfloat16", True, None, None, id="T37-qk48-v32-bf16-causal"),
]


@pytest.mark.parametrize("T,dqk,dv,dtype,causal,scale,config", CASES)
def test_flash_matches_reference(T, dqk, dv, dtype, causal, scale, config):
    """Values and the three gradients against the float32 softmax (``TOLERANCE``), in the inputs' dtype."""
    p = attention(2, T, 2, dqk, dv, dtype, scale)
    check(p, *make_inputs(p, 0), config=config, refs=("xla",), causal=causal)


def test_causal_output_ignores_future_tokens():
    x, _ = make_inputs(attention(1, 50, 1, 16, 16), 0)
    o = flash.flash_attention(x["q"], x["k"], x["v"], config=SMALL, interpret=True)
    late = x["v"].at[:, 30:].set(100.0)  # changing values from t=30 on must not move outputs before t=30
    o2 = flash.flash_attention(x["q"], x["k"], late, config=SMALL, interpret=True)
    np.testing.assert_array_equal(o[:, :30], o2[:, :30])
    assert not np.allclose(o[:, 30:], o2[:, 30:])


def test_api_dispatch_on_cpu():
    x, _ = make_inputs(attention(1, 20, 2, 24, 16), 0)
    q, k, v = x["q"], x["k"], x["v"]
    assert cudnn.auto_impl(q, v) == "xla"
    want = reference.naive_attention(q, k, v)
    np.testing.assert_array_equal(kernels.attention(q, k, v), want)
    np.testing.assert_allclose(kernels.attention(q, k, v, impl="pallas_interpret"), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="share a dtype"):
        flash.flash_attention(q, k, v.astype(jnp.bfloat16), interpret=True)


def test_cudnn_head_dim_rule():
    bf = lambda d: jnp.zeros((1, 4, 1, d), jnp.bfloat16)
    assert cudnn.cudnn_head_dim(bf(64), bf(64)) == 64
    assert cudnn.cudnn_head_dim(bf(48), bf(32)) == 48
    assert cudnn.cudnn_head_dim(bf(20), bf(30)) == 32
    assert cudnn.cudnn_head_dim(bf(192), bf(128)) is None
    assert cudnn.cudnn_head_dim(bf(64).astype(jnp.float32), bf(64)) is None


@pytest.mark.parametrize("dqk,dv", [(48, 32), (16, 40)])
def test_cudnn_padding_keeps_the_math(monkeypatch, dqk, dv):
    """The head-dim padding around cuDNN is exact: checked with XLA standing in for cuDNN (no GPU here)."""
    dpa = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: dpa(*a, **{**kw, "implementation": "xla"}))
    x, _ = make_inputs(attention(1, 33, 2, dqk, dv, "bfloat16"), 0)
    o = cudnn.cudnn_attention(x["q"], x["k"], x["v"], causal=True)
    want = reference.naive_attention(x["q"], x["k"], x["v"])
    assert o.shape == want.shape
    assert rel_rms(o, want) <= 5e-3


ATTENTION_TILES = tuning.AttentionConfig(fwd=tuning.AttentionKernel(32, 16), dkdv=tuning.AttentionKernel(16, 32),
                                         dq=tuning.AttentionKernel(16, 16))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attention_with_documents(causal):
    """The Pallas flash kernel (small tiles, ragged T) against the masked reference, values and gradients; with
    NaN in the values of a document's key blocks that no later document needs, the later documents' outputs and
    gradients stay finite and unchanged: those blocks are skipped, not masked."""
    p = attention(2, 77, 2, 24, 16)
    x, ct = make_inputs(p, 4)
    seg = segment_ids(p.T, [[1, 5, 16, 17, 40, 63], [31, 32, 70]])
    check(p, x, ct, config=ATTENTION_TILES, refs=("xla",), tol=Tolerance(1e-5, 1e-5), segment_ids=seg, causal=causal)
    q, k, v = x["q"], x["k"], x["v"]
    flash_docs = lambda v: flash.flash_attention(q, k, v, causal=causal, config=ATTENTION_TILES,  # noqa: E731
                                                 interpret=True, segment_ids=seg)
    # row 0's query blocks of 32 from position 32 on hold documents that start at 17 or later, so the forward
    # never visits key block [0, 16) for them
    v_nan = v.at[0, :16].set(jnp.nan)
    np.testing.assert_allclose(flash_docs(v_nan)[0, 32:], flash_docs(v)[0, 32:], rtol=1e-6, atol=1e-6)
    # the plain mask is not enough: the reference multiplies NaN by zero probabilities
    masked = reference.naive_attention(q, k, v_nan, causal=causal, segment_ids=seg)
    assert np.isnan(np.asarray(masked[0, 32:])).all()


def test_attention_api_documents():
    """``kernels.attention`` hands ``segment_ids`` to every implementation (XLA and the flash kernel agree); no
    documents at all (all-zero ids) is plain causal attention."""
    x, _ = make_inputs(attention(1, 40, 2, 16, 16), 5)
    q, k, v = x["q"], x["k"], x["v"]
    seg = segment_ids(40, [[9, 30]])
    o = {impl: kernels.attention(q, k, v, impl=impl, segment_ids=seg) for impl in ("xla", "pallas_interpret")}
    assert rel_rms(o["pallas_interpret"], o["xla"]) <= 1e-5
    np.testing.assert_allclose(o["xla"][:, :9], kernels.attention(q[:, :9], k[:, :9], v[:, :9], impl="xla"),
                               atol=1e-6)
    np.testing.assert_array_equal(kernels.attention(q, k, v, impl="xla", segment_ids=jnp.zeros((1, 40), jnp.int32)),
                                  kernels.attention(q, k, v, impl="xla"))
