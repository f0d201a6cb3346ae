"""Packed documents through the whole model: a batch of several documents, kept apart by ``segment_ids``, gives
every document the logits and the parameter gradients it gets alone, for the demo model (every sublayer kind:
MLA, GDN, KDA, Mamba2, MLP), float32, in each kernel implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.model import HybridLM
from hybrid_jax.model.layers import ShortConv
from hybrid_jax.model.mla import document_positions
from tests.conftest import load_config, rel_err

# one window of 40 tokens: documents of 7, 1, 16, 3 and 13 tokens (chunks of 16: starts at rows 7, 8, 8, 11, 11)
LENGTHS = (7, 1, 16, 3, 13)


def packed_and_alone(seed: int):
    """``(tokens [1,T], segment_ids [1,T], alone [n,L], mask [n,L])``: the packed window and each document alone,
    right-padded (a causal model's outputs at a document's positions do not see the padding)."""
    T, L = sum(LENGTHS), max(LENGTHS)
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (1, T), 0, 512)
    seg = jnp.asarray(np.repeat(np.arange(len(LENGTHS)), LENGTHS)[None], jnp.int32)
    starts = np.cumsum((0,) + LENGTHS[:-1])
    alone = jnp.stack([jnp.pad(tokens[0, s:s + n], (0, L - n), constant_values=1)
                       for s, n in zip(starts, LENGTHS, strict=True)])
    mask = jnp.asarray(np.arange(L)[None, :] < np.asarray(LENGTHS)[:, None])
    return tokens, seg, alone, mask, starts


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])  # naive: its resets are pinned in test_segments.py
def test_packed_documents_equal_each_document_alone(impl):
    cfg = load_config("demo").model
    cfg.kernel_impl, cfg.reset_positions = impl, True
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    # each document alone, and the control, through the XLA forms (equal to the Pallas kernels' within 1e-6 in
    # float32: tests/kernels), so that only the packed run compiles the interpreted kernels
    cfg_xla = cfg.copy_and_resolve_references()
    cfg_xla.kernel_impl = "xla"
    graphdef_xla = nnx.split(HybridLM(cfg_xla, rngs=nnx.Rngs(0)), nnx.Param)[0]
    tokens, seg, alone, mask, starts = packed_and_alone(1)
    w = jax.random.normal(jax.random.PRNGKey(2), (tokens.shape[1], cfg.vocab_size))
    w_alone = jnp.stack([jnp.pad(w[s:s + n], ((0, alone.shape[1] - n), (0, 0)))
                         for s, n in zip(starts, LENGTHS, strict=True)])

    def loss(params, tokens, seg, weights, graphdef):
        logits = nnx.merge(graphdef, params)(tokens, seg)
        return jnp.sum(logits * weights), logits

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=4)
    (_, logits), grads = value_and_grad(params, tokens, seg, w[None], graphdef)
    (_, logits_alone), grads_alone = value_and_grad(params, alone, None, w_alone, graphdef_xla)
    for d, (s, n) in enumerate(zip(starts, LENGTHS, strict=True)):
        assert rel_err(logits[0, s:s + n], logits_alone[d, :n]) <= 1e-5, d
    flat, flat_alone = jax.tree.leaves(grads), jax.tree.leaves(grads_alone)
    assert len(flat) == len(flat_alone) > 20
    for g, g_alone in zip(flat, flat_alone, strict=True):
        assert rel_err(g, g_alone) <= 1e-5
    # the documents do interact without the ids: the check above can fail
    plain = jax.jit(lambda p, t: nnx.merge(graphdef_xla, p)(t))(params, tokens)
    assert rel_err(plain[0, 7:], logits[0, 7:]) > 1e-3


def test_short_conv_reads_no_tap_of_another_document():
    conv = ShortConv(3, 4, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 9, 3))
    seg = jnp.asarray([[0, 0, 0, 0, 1, 2, 2, 2, 2]])
    y = conv(x, seg)
    np.testing.assert_allclose(y[:, :4], conv(x[:, :4]), rtol=1e-6)
    np.testing.assert_allclose(y[:, 4:5], conv(x[:, 4:5]), rtol=1e-6)
    np.testing.assert_allclose(y[:, 5:], conv(x[:, 5:]), rtol=1e-6)
    assert not np.allclose(y[:, 5:], conv(x)[:, 5:])


def test_document_positions():
    seg = jnp.asarray([[0, 0, 0, 1, 2, 2], [3, 3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(document_positions(seg), [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
