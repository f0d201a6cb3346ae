"""Packed documents (``segment_ids``): every recurrent implementation restarts the state at each new document.

The ground truth is the token-by-token recurrence with resets (``reference.naive_recurrence``), itself checked
against running each document alone. The chunked XLA form and the Pallas kernels (interpret mode) must match it in
values and in every input's gradient, with boundaries at every row position of a chunk, several per chunk,
one-token documents, ragged T, grouped value heads and gates down to -20 per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from hybrid_jax.kernels import api, reference, tuning
from hybrid_jax.kernels.recurrent import segments
from tests.kernels.test_pallas_recurrence import make_inputs, naive, pallas, rel_rms, value_and_grads, xla


def segment_ids(T: int, starts: list[list[int]]) -> jax.Array:
    """``[len(starts), T]`` int32: row ``b``'s documents begin at ``starts[b]`` (besides position 0)."""
    seg = np.zeros((len(starts), T), np.int32)
    for b, row in enumerate(starts):
        for s in row:
            seg[b, s:] += 1
    return jnp.asarray(seg)


# T = 37 in chunks of 16: starts at a chunk's first row (16, 32) and last (15, 31), several per chunk, one-token
# documents (5, 6, ...), the ragged tail's last token (36); together every row position of a 16-row chunk. The
# second row's last chunk (rows 32-36, and at chunk 32 rows 32-63) lies inside one document that began earlier.
STARTS = [[1, 5, 6, 15, 16, 18, 19, 23, 26, 29, 31, 32, 34, 36], [8, 9, 11, 12, 14, 17, 24, 28, 30]]


def with_segments(fn, seg):
    return lambda *args, **kw: fn(*args, segment_ids=seg, **kw)


def inputs_for(kind: str, seed: int, B: int, T: int = 37):
    """Inputs with 1 q/k head and 2 value heads and mild gates (so that a state leaking across a boundary would
    show), except rows ``T//2 .. T//2 + 7``: gates down to -20 per step."""
    mild, weights = make_inputs(seed, B=B, T=T, H=1, HV=2, delta=kind != "gla", per_key=kind == "kda")
    g = mild["g"]
    steep = jax.random.uniform(jax.random.PRNGKey(seed), (B, 8, *g.shape[2:]), minval=-20.0, maxval=0.0)
    return dict(mild, g=g.at[:, T // 2: T // 2 + 8].set(steep.at[:, ::3].set(-20.0))), weights


def compare(fn, ref, inputs, weights, tol: float) -> None:
    o, ht, grads = value_and_grads(fn, inputs, weights, final_state=True)
    o_r, ht_r, grads_r = value_and_grads(ref, inputs, weights, final_state=True)
    assert rel_rms(o, o_r) <= tol and rel_rms(ht, ht_r) <= tol
    assert set(grads) == set(grads_r)
    for name, grad in grads.items():
        assert np.all(np.isfinite(np.asarray(grad))), name
        assert rel_rms(grad, grads_r[name]) <= tol, (name, rel_rms(grad, grads_r[name]))


@pytest.mark.parametrize("kind", ["gdn", "gla", "kda"])
def test_naive_resets_are_each_document_alone(kind):
    """The packed recurrence is each document run alone: the first from the initial state, the others from zero;
    the final state is the last document's. (Each document alone is one batch row, padded with ``k = v = g = beta
    = 0``, which changes neither its outputs nor its final state.)"""
    inputs, _ = inputs_for(kind, 0, B=1)
    starts = [5, 6, 20, 31]
    seg = segment_ids(37, [starts])
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    o, final = reference.naive_recurrence(*args, initial_state=inputs["h0"], segment_ids=seg, use_qk_l2norm=True)
    bounds = list(zip([0, *starts], [*starts, 37], strict=True))
    alone = [None if x is None else jnp.concatenate(
        [jnp.pad(x[:, lo:hi], [(0, 0), (0, 37 - hi + lo)] + [(0, 0)] * (x.ndim - 2)) for lo, hi in bounds])
        for x in args]
    h0 = jnp.zeros((len(bounds), *inputs["h0"].shape[1:])).at[0].set(inputs["h0"][0])
    o_alone, final_alone = reference.naive_recurrence(*alone, initial_state=h0, use_qk_l2norm=True)
    for d, (lo, hi) in enumerate(bounds):
        np.testing.assert_allclose(o[0, lo:hi], o_alone[d, : hi - lo], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(final[0], final_alone[-1], rtol=1e-6, atol=1e-6)
    # and a reset is not a no-op (the batch's first row has mild gates): without it later documents differ
    o_plain, _ = reference.naive_recurrence(*args, initial_state=inputs["h0"], use_qk_l2norm=True)
    assert rel_rms(o_plain[:, 5:], o[:, 5:]) > 1e-2


@pytest.mark.parametrize("kind, chunk", [("gdn", 16), ("gla", 16), ("kda", 32)])
def test_xla_chunked_form_with_every_boundary_position(kind, chunk):
    """Row ``b`` of the batch has a document start at row ``b`` of the second chunk and two more, so together the
    batch puts one at every row position of a chunk (and many documents shorter than a chunk)."""
    T = 2 * chunk + 5
    starts = [sorted({chunk + b, (3 * b + 1) % T or 1, min(T - 1, chunk + b + 2)}) for b in range(chunk)]
    inputs, weights = inputs_for(kind, 1, B=chunk, T=T)
    seg = segment_ids(T, starts)
    compare(with_segments(xla(chunk), seg), with_segments(naive, seg), inputs, weights, tol=2e-5)


# every kernel variant the segment masks touch: the split gradient pass (its WY launch), the output in the forward
# state pass (P from wy), hdh from the reverse state pass, two V tiles, the kernels summing the gate, two chunks
# per program (at T = 59: four chunks of 16, the last ragged; the documents of STARTS, then one to the end)
VARIANTS = dict(split_grad_from=0, output_in_state=True, state_bwd_hdh_from=0, block_v=16,
                gate_cumsum_in_kernels=True, chunks_per_program=2, chunks_per_program_from=0)


@pytest.mark.parametrize("kind, chunk, variants, branch", [
    ("gdn", 16, False, True), ("gla", 16, False, True), ("kda", 32, False, False), ("gdn", 16, True, True),
    ("kda", 16, True, False)])
def test_pallas_kernels_with_documents(kind, chunk, variants, branch):
    """Values, final state and every input's gradient against the naive recurrence with resets (float32).
    KDA at chunk 32: two 16-row blocks per chunk, and gates of -20 make the levels launches redo far rows.
    ``branch`` (``RecurrentConfig.documents_branch``): the chunk-parallel launches run the chunks inside one
    document without the masks and the others with them (the second row's last chunk is of the first kind), with
    one and with two chunks per program; else the masked kernel on every chunk."""
    T = 59 if variants else 37
    inputs, weights = inputs_for(kind, 2, B=len(STARTS), T=T)
    config = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), documents_branch=branch,
                                 **(VARIANTS if variants else {}))
    seg = segment_ids(T, STARTS)
    compare(with_segments(pallas(chunk, config), seg), with_segments(naive, seg), inputs, weights, tol=5e-5)


def test_api_segments_every_impl_and_checks():
    """Through the public API every implementation gives the same result; all-zero ids are no documents at all
    (bit for bit with ``None`` on the XLA form); malformed ids are refused."""
    inputs, _ = inputs_for("gdn", 3, B=2, T=20)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    seg = segment_ids(20, [[4, 9], [16]])
    outs = {impl: api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=inputs["h0"], output_final_state=True,
                                             use_qk_l2norm=True, chunk_size=16, impl=impl, segment_ids=seg)
            for impl in ("naive", "xla")}
    for impl in ("xla",):
        assert rel_rms(outs[impl][0], outs["naive"][0]) <= 1e-5
        assert rel_rms(outs[impl][1], outs["naive"][1]) <= 1e-5
    gla = {impl: api.chunk_simple_gla(q, k, v, g, chunk_size=16, impl=impl, segment_ids=seg)[0]
           for impl in ("naive", "pallas_interpret")}
    assert rel_rms(gla["pallas_interpret"], gla["naive"]) <= 1e-5
    zeros, none = (api.chunk_simple_gla(q, k, v, g, chunk_size=16, impl="xla", segment_ids=s)[0]
                   for s in (jnp.zeros((2, 20), jnp.int32), None))
    np.testing.assert_array_equal(zeros, none)
    with pytest.raises(ValueError, match="segment_ids"):
        api.chunk_simple_gla(q, k, v, g, impl="xla", segment_ids=jnp.zeros((2, 19), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        api.chunk_simple_gla(q, k, v, g, impl="xla", segment_ids=jnp.zeros((2, 20), jnp.float32))


def test_chunk_segments():
    """Each row's document relative to the one its chunk carries in; the padding joins the last document."""
    seg = jnp.asarray([[0, 0, 1, 1, 1, 2, 2]])
    np.testing.assert_array_equal(reference.chunk_segments(seg, 4), [[0, 0, 1, 1, 0, 1, 1, 1]])
    np.testing.assert_array_equal(reference.chunk_segments(jnp.asarray([[3, 3, 4, 4, 5]]), 2),
                                  [[0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_sequential_passes_see_each_chunks_keep_bit(reverse):
    """``segments.chunk_keeps`` packs 70 chunks' keep bits into words (three, padded to four, the top bit of a word
    included) and ``loop_over_chunks`` hands each step its chunk's bit, in either direction; the Pallas loop
    here records what each step got."""
    C, N = 2, 70
    last = np.random.default_rng(0).integers(0, 2, (2, N))  # each chunk's last row: carried document (0) or not
    last[:, 31], last[:, 63] = 0, 0  # bit 31 of words 0 and 1: the sign bit of an int32
    rel = jnp.asarray(np.repeat(last, C, axis=1), jnp.int32)
    words = segments.chunk_keeps(rel, C)
    assert words.shape == (2, 4) and words.dtype == jnp.int32

    def kernel(keep_ref, out_ref):
        def body(step, state, keep):
            out_ref[pl.ds(N - 1 - step if reverse else step, 1)] = jnp.full((1,), keep, jnp.int32)
            return state + 1.0

        segments.loop_over_chunks(body, N, jnp.zeros((), jnp.float32), keep_ref, reverse=reverse)

    got = pl.pallas_call(kernel, grid=(2,), in_specs=[pl.BlockSpec((None, 4), lambda b: (b, 0))],
                         out_specs=pl.BlockSpec((None, N), lambda b: (b, 0)),
                         out_shape=jax.ShapeDtypeStruct((2, N), jnp.int32), interpret=True)(words)
    np.testing.assert_array_equal(got, last == 0)


# ------------------------------------------------------------------------------------------------- attention
ATTENTION_TILES = tuning.AttentionConfig(fwd=tuning.AttentionKernel(32, 16), dkdv=tuning.AttentionKernel(16, 32),
                                         dq=tuning.AttentionKernel(16, 16))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attention_with_documents(causal):
    """The Pallas flash kernel (small tiles, ragged T) against the masked reference, values and gradients; with
    NaN in the values of a document's key blocks that no later document needs, the later documents' outputs and
    gradients stay finite and unchanged: those blocks are skipped, not masked."""
    from hybrid_jax.kernels.flash_attention import flash_attention

    B, T, H = 2, 77, 2
    ks = jax.random.split(jax.random.PRNGKey(4), 4)
    q, k = (jax.random.normal(x, (B, T, H, 24)) for x in ks[:2])
    v, w = (jax.random.normal(x, (B, T, H, 16)) for x in ks[2:])
    seg = segment_ids(T, [[1, 5, 16, 17, 40, 63], [31, 32, 70]])

    def value_and_grad(fn, v):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)

    flash = lambda q, k, v: flash_attention(q, k, v, causal=causal, config=ATTENTION_TILES, interpret=True,  # noqa
                                            segment_ids=seg)
    masked = lambda q, k, v: reference.naive_attention(q, k, v, causal=causal, segment_ids=seg)  # noqa: E731
    out, grads = value_and_grad(flash, v)
    out_r, grads_r = value_and_grad(masked, v)
    assert rel_rms(flash(q, k, v), masked(q, k, v)) <= 1e-5
    for g, g_r in zip(grads, grads_r, strict=True):
        assert rel_rms(g, g_r) <= 1e-5
    # row 0's query blocks of 32 from position 32 on hold documents that start at 17 or later, so the forward
    # never visits key block [0, 16) for them
    v_nan = v.at[0, :16].set(jnp.nan)
    np.testing.assert_allclose(flash(q, k, v_nan)[0, 32:], flash(q, k, v)[0, 32:], rtol=1e-6, atol=1e-6)
    # the plain mask is not enough: the reference multiplies NaN by zero probabilities
    assert np.isnan(np.asarray(masked(q, k, v_nan)[0, 32:])).all()


def test_attention_api_documents():
    """``api.attention`` hands ``segment_ids`` to every implementation (XLA and the flash kernel agree); no
    documents at all (all-zero ids) is plain causal attention."""
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 40, 2, 16)) for i in range(3))
    seg = segment_ids(40, [[9, 30]])
    o = {impl: api.attention(q, k, v, impl=impl, segment_ids=seg) for impl in ("xla", "pallas_interpret")}
    assert rel_rms(o["pallas_interpret"], o["xla"]) <= 1e-5
    np.testing.assert_allclose(o["xla"][:, :9], api.attention(q[:, :9], k[:, :9], v[:, :9], impl="xla"), atol=1e-6)
    np.testing.assert_array_equal(api.attention(q, k, v, impl="xla", segment_ids=jnp.zeros((1, 40), jnp.int32)),
                                  api.attention(q, k, v, impl="xla"))
