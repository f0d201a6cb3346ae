"""Packed documents through the whole model: a batch of several documents, kept apart by ``segment_ids``, gives
every document the logits and the parameter gradients it gets alone, for the demo model (every sublayer kind:
MLA, GDN, KDA, Mamba2, MLP), float32, in each kernel implementation; on a GPU also in bfloat16 at the 300M
configs' head dims, through the Pallas kernels and through ``auto`` (cuDNN attention where it takes the shape)."""

from __future__ import annotations

import json

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


def packed_and_alone(seed: int, lengths: tuple[int, ...] = LENGTHS, vocab: int = 512):
    """``(tokens [1,T], segment_ids [1,T], alone [n,L], starts)``: the packed window and each document alone,
    right-padded (a causal model's outputs at a document's positions do not see the padding)."""
    T, L = sum(lengths), max(lengths)
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (1, T), 0, vocab)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    starts = np.cumsum((0,) + lengths[:-1])
    alone = jnp.stack([jnp.pad(tokens[0, s:s + n], (0, L - n), constant_values=1)
                       for s, n in zip(starts, lengths, strict=True)])
    return tokens, seg, alone, starts


def logits_and_grads(cfg, tokens, seg, weights=None) -> tuple[jax.Array, list[jax.Array] | None]:
    """The model of ``cfg`` (parameters from seed 0, whatever its kernels and dtype) on ``tokens`` (``seg``: their
    segment ids, or None): float32 logits and the parameter gradients of ``sum(logits * weights)`` (None without
    ``weights``)."""
    graphdef, params = nnx.split(HybridLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    if weights is None:
        return jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, seg).astype(jnp.float32))(params), None

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, seg).astype(jnp.float32)
        return jnp.sum(logits * weights), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, jax.tree.leaves(grads)


def documents(cfg, lengths: tuple[int, ...], alone: list) -> dict:
    """The packed window of documents of ``lengths`` under ``cfg`` and, for each config of ``alone``, each document
    alone. -> ``packed``, ``alone`` (a list): each ``(logits of every document's tokens [sum(lengths), vocab],
    parameter gradients)``; ``without_ids``: the relative error of the window's logits run without the ids (through
    ``alone[0]``) after its first document (the documents do interact then: the checks can fail)."""
    tokens, seg, padded, starts = packed_and_alone(1, lengths, cfg.vocab_size)
    w = jax.random.normal(jax.random.PRNGKey(2), (tokens.shape[1], cfg.vocab_size))
    w_alone = jnp.stack([jnp.pad(w[s:s + n], ((0, padded.shape[1] - n), (0, 0)))
                         for s, n in zip(starts, lengths, strict=True)])
    logits, grads = logits_and_grads(cfg, tokens, seg, w[None])
    out = dict(packed=(logits[0], grads), alone=[])
    for c in alone:
        logits_alone, grads_alone = logits_and_grads(c, padded, None, w_alone)
        out["alone"].append((jnp.concatenate([logits_alone[d, :n] for d, n in enumerate(lengths)]), grads_alone))
    plain = logits_and_grads(alone[0], tokens, None)[0]
    out["without_ids"] = rel_err(plain[0, lengths[0]:], logits[0, lengths[0]:])
    return out


def with_(cfg, **changes):
    c = cfg.copy_and_resolve_references()
    c.update(changes)
    return c


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])  # naive: its resets are pinned in test_segments.py
def test_packed_documents_equal_each_document_alone(impl):
    cfg = load_config("demo").model
    cfg.kernel_impl, cfg.reset_positions = impl, True
    # each document alone through the XLA forms (equal to the Pallas kernels' within 1e-6 in float32:
    # tests/kernels), so that only the packed run compiles the interpreted kernels
    out = documents(cfg, LENGTHS, [with_(cfg, kernel_impl="xla")])
    (logits, grads), [(logits_alone, grads_alone)] = out["packed"], out["alone"]
    starts = np.cumsum((0,) + LENGTHS)
    for d in range(len(LENGTHS)):
        assert rel_err(logits[starts[d]:starts[d + 1]], logits_alone[starts[d]:starts[d + 1]]) <= 1e-5, d
    assert len(grads) == len(grads_alone) > 20
    for g, g_alone in zip(grads, grads_alone, strict=True):
        assert rel_err(g, g_alone) <= 1e-5
    assert out["without_ids"] > 1e-3


# one 2048-token window of FineWeb-like lengths: documents of 1 and of more than a chunk, starts at chunk rows
GPU_LENGTHS = (300, 1, 64, 700, 983)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="bfloat16 kernels at the configs' shapes need a GPU")
@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_packed_documents_bfloat16_on_gpu(impl):
    """bfloat16 compute at the 300M configs' head dims (GDN K=V=64, KDA K=32 V=64, Mamba2 64/64, MLA qk 64 v 64):
    packing adds no error. Against each document alone in float32 (XLA forms), the packed bfloat16 run's error is
    at most 1.25x (+1e-3) that of each document alone in bfloat16 through the same kernels, for the logits and for
    the gradients (the RMS over parameters of each one's relative error). (Two bfloat16 runs of one document that
    round differently are 2-3e-2 apart in the logits of this 8-layer model, the error each has against float32.)
    Prints the errors as one JSON line."""
    cfg = load_config("demo").model
    cfg.update(dict(kernel_impl=impl, reset_positions=True, dtype="bfloat16", chunk_size=0, hidden_size=256,
                    vocab_size=4096))
    cfg.gdn.update(dict(num_key_heads=2, num_value_heads=4, key_head_dim=64, value_head_dim=64))
    cfg.kda.update(dict(num_key_heads=4, num_value_heads=4, key_head_dim=32, value_head_dim=64))
    cfg.mamba2.update(dict(state_dim=64, head_dim=64, num_groups=2))
    cfg.mla.update(dict(num_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                        v_head_dim=64, original_max_position_embeddings=2048))
    out = documents(cfg, GPU_LENGTHS, [cfg, with_(cfg, kernel_impl="xla", dtype="float32")])
    (logits, grads), [(logits_alone, grads_alone), (logits_f32, grads_f32)] = out["packed"], out["alone"]

    def grads_err(gs):
        return float(np.sqrt(np.mean([rel_err(g, ref) ** 2 for g, ref in zip(gs, grads_f32, strict=True)])))

    starts = np.cumsum((0,) + GPU_LENGTHS)
    e = dict(impl=impl, lengths=GPU_LENGTHS, packed_vs_alone_logits=max(
        rel_err(logits[a:b], logits_alone[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)),
        logits_packed=rel_err(logits, logits_f32), logits_alone=rel_err(logits_alone, logits_f32),
        grads_packed=grads_err(grads), grads_alone=grads_err(grads_alone), without_ids=out["without_ids"])
    print("packed_bf16", json.dumps(e))
    assert e["logits_packed"] <= 1.25 * e["logits_alone"] + 1e-3, e
    assert e["grads_packed"] <= 1.25 * e["grads_alone"] + 1e-3, e
    assert e["without_ids"] > 3 * e["logits_alone"], e  # the check resolves documents that interact


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
