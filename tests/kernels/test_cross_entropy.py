"""The cross-entropy's softmax-gradient kernel (interpret mode) against the gradient of ``log_softmax`` and against
its XLA form, with a ragged last column tile, rows that do not fill the table's row block and confident rows; the
chunked loss with it equals the loss with the XLA form; it lowers for every GPU arch, writing ``dlogits`` over the
logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.cross_entropy import softmax_grad, softmax_grad_reference
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower
from hybrid_jax.train.step.loss import cross_entropy


def _inputs(C: int, V: int, dtype, seed: int = 0):
    kx, kt, kw = jax.random.split(jax.random.key(seed), 3)
    x = 4.0 * jax.random.normal(kx, (C, V))
    t = jax.random.randint(kt, (C,), 0, V)
    x = x.at[0, t[0]].set(25.0)  # a confident row: its target gradient 1 - p (~1e-4) is far below bf16's step at 1
    w = jax.random.uniform(kw, (C,), minval=0.5, maxval=2.0)
    return x.astype(dtype), t, w


@pytest.mark.parametrize("C, V, rows, block_v, dtype", [
    (24, 1000, 8, 256, jnp.float32),  # 3 full column tiles and a masked one of 232
    (6, 1000, 4, 512, jnp.bfloat16),  # 6 rows: programs of 2 (the gcd with 4); one full tile, one masked
    (16, 512, 4, 128, jnp.bfloat16),  # the vocabulary a multiple of the tile: no masked tile
])
def test_softmax_grad_is_the_gradient_of_log_softmax(C, V, rows, block_v, dtype):
    x, t, w = _inputs(C, V, dtype)
    config = tuning.CrossEntropyConfig(rows=rows, block_v=block_v)
    dlogits, lse = softmax_grad(x, t, w, impl="pallas_interpret", config=config)
    assert dlogits.dtype == dtype and dlogits.shape == (C, V) and lse.dtype == jnp.float32

    def loss(x):  # the ground truth, float32 from the stored logits
        logp = jax.nn.log_softmax(x, axis=-1)
        return -jnp.sum(w * jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0])

    x32 = x.astype(jnp.float32)
    want = jax.grad(loss)(x32)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(x32, axis=-1), rtol=1e-6)
    tol = 1e-5 if dtype == jnp.float32 else 2e-3  # bf16: one rounding of the result
    np.testing.assert_allclose(np.asarray(dlogits, np.float32), want, rtol=tol, atol=tol * float(w.max()))
    # the confident row keeps its small target gradient: - onehot applied before the rounding
    p = jnp.exp(x32[0, t[0]] - lse[0])
    np.testing.assert_allclose(float(dlogits[0, t[0]]), float(w[0] * (p - 1)), rtol=1e-2)
    assert float(dlogits[0, t[0]]) != 0.0
    ref, ref_lse = softmax_grad_reference(x, t, w)
    np.testing.assert_allclose(np.asarray(dlogits, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=1e-7)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_chunked_loss_with_the_kernel_equals_the_xla_form():
    """Values and both gradients of the chunked cross-entropy in bf16, ragged last chunk and vocabulary."""
    kh, ke, kt = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(kh, (2, 21, 32)).astype(jnp.bfloat16)
    e = 0.3 * jax.random.normal(ke, (300, 32))
    t = jax.random.randint(kt, (2, 21), 0, 300)

    def run(impl):
        f = lambda h, e: cross_entropy(h, e, t, chunk_size=16, impl=impl)  # noqa: E731
        return jax.jit(jax.value_and_grad(f, (0, 1)))(h, e)

    (loss, grads), (want, want_grads) = run("pallas_interpret"), run("xla")
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_lowers_to_triton(arch):
    args = (jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16), jax.ShapeDtypeStruct((64,), jnp.int32),
            jax.ShapeDtypeStruct((64,), jnp.float32))
    fn = lambda x, t, w: softmax_grad(x, t, w, impl="pallas", config=tuning.cross_entropy_config(arch))  # noqa: E731
    text = lower(fn, args, arch)
    assert text.count(TRITON_CALL) == 1
    # dlogits (output 0) is written over the logits (operand 0): the chunk holds one [C, V] buffer
    assert "output_operand_alias<output_tuple_indices = [0], operand_index = 0," in text
