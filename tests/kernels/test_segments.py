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
from hybrid_jax.kernels.tooling.calls import errors_against
from hybrid_jax.kernels.tooling.errors import Tolerance, over
from tests.kernels.conftest import check, make_inputs, problem, rel_rms, segment_ids, steep_gates

# T = 37 in chunks of 16: starts at a chunk's first row (16, 32) and last (15, 31), several per chunk, one-token
# documents (5, 6, ...), the ragged tail's last token (36); together every row position of a 16-row chunk. The
# second row's last chunk (rows 32-36, and at chunk 32 rows 32-63) lies inside one document that began earlier.
STARTS = [[1, 5, 6, 15, 16, 18, 19, 23, 26, 29, 31, 32, 34, 36], [8, 9, 11, 12, 14, 17, 24, 28, 30]]


def inputs_for(kind: str, seed: int, B: int, T: int = 37, chunk: int = 16):
    """A problem with 1 q/k head and 2 value heads, its inputs (the model's gates: some heads' states reach across
    many tokens, so a state leaking across a boundary would show) with rows ``T//2 .. T//2 + 7`` steep (gates down to
    -20 per step), and cotangents."""
    p = problem(kind, B=B, T=T, chunk=chunk)
    x, ct = make_inputs(p, seed)
    return p, steep_gates(x, -20.0, seed, rows=slice(T // 2, T // 2 + 8)), ct


@pytest.mark.parametrize("kind", ["gdn", "gla", "kda"])
def test_naive_resets_are_each_document_alone(kind):
    """The packed recurrence is each document run alone: the first from the initial state, the others from zero;
    the final state is the last document's. (Each document alone is one batch row, padded with ``k = v = g = beta
    = 0``, which changes neither its outputs nor its final state.)"""
    _, inputs, _ = inputs_for(kind, 0, B=1)
    starts = [5, 6, 20, 31]
    seg = segment_ids(37, [starts])
    args = [inputs.get(n) for n in ("q", "k", "v", "g", "beta")]
    o, final = reference.naive_recurrence(*args, initial_state=inputs["initial_state"], segment_ids=seg,
                                          use_qk_l2norm=True)
    bounds = list(zip([0, *starts], [*starts, 37], strict=True))
    alone = [None if x is None else jnp.concatenate(
        [jnp.pad(x[:, lo:hi], [(0, 0), (0, 37 - hi + lo)] + [(0, 0)] * (x.ndim - 2)) for lo, hi in bounds])
        for x in args]
    h0 = jnp.zeros((len(bounds), *inputs["initial_state"].shape[1:])).at[0].set(inputs["initial_state"][0])
    o_alone, final_alone = reference.naive_recurrence(*alone, initial_state=h0, use_qk_l2norm=True)
    for d, (lo, hi) in enumerate(bounds):
        np.testing.assert_allclose(o[0, lo:hi], o_alone[d, : hi - lo], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(final[0], final_alone[-1], rtol=1e-6, atol=1e-6)
    # and a reset is not a no-op (the batch's first row has mild gates): without it later documents differ
    o_plain, _ = reference.naive_recurrence(*args, initial_state=inputs["initial_state"], use_qk_l2norm=True)
    assert rel_rms(o_plain[:, 5:], o[:, 5:]) > 1e-2


@pytest.mark.parametrize("kind, chunk", [("gdn", 16), ("gla", 16), ("kda", 32)])
def test_xla_chunked_form_with_every_boundary_position(kind, chunk):
    """Row ``b`` of the batch has a document start at row ``b`` of the second chunk and two more, so together the
    batch puts one at every row position of a chunk (and many documents shorter than a chunk)."""
    T = 2 * chunk + 5
    starts = [sorted({chunk + b, (3 * b + 1) % T or 1, min(T - 1, chunk + b + 2)}) for b in range(chunk)]
    p, x, ct = inputs_for(kind, 1, B=chunk, T=T, chunk=chunk)
    errs = errors_against(p, "xla", "naive", x, ct, segment_ids=segment_ids(T, starts))
    assert not over(errs, Tolerance(2e-5, 2e-5)), errs


# every kernel variant the segment masks touch: the split gradient pass (its WY launch), the output in the forward
# state pass (P from wy), hdh from the reverse state pass, two V tiles, the kernels summing the gate, two chunks
# per program (at T = 59: four chunks of 16, the last ragged; the documents of STARTS, then one to the end)
VARIANTS = dict(split_grad_from=0, output_in_state=True, state_bwd_hdh_from=0, block_v=16,
                gate_cumsum_in_kernels=True, chunks_per_program=2, chunks_per_program_from=0)


@pytest.mark.parametrize("kind, chunk, variants, branch", [
    ("gdn", 16, False, True), ("gla", 16, False, True), ("kda", 32, False, False), ("gdn", 16, True, True),
    ("gla", 16, True, True), ("kda", 16, True, False)])
def test_pallas_kernels_with_documents(kind, chunk, variants, branch):
    """Values, final state and every input's gradient against the naive recurrence with resets (float32).
    KDA at chunk 32: two 16-row blocks per chunk, and gates of -20 make the levels launches redo far rows.
    ``branch`` (``RecurrentConfig.documents_branch``): the chunk-parallel launches run the chunks inside one
    document without the masks and the others with them (the second row's last chunk is of the first kind), with
    one and with two chunks per program; else the masked kernel on every chunk."""
    T = 59 if variants else 37
    p, x, ct = inputs_for(kind, 2, B=len(STARTS), T=T, chunk=chunk)
    config = dataclasses.replace(tuning.recurrent_config(per_key=kind == "kda"), documents_branch=branch,
                                 **(VARIANTS if variants else {}))
    check(p, x, ct, config=config, refs=("naive",), tol=Tolerance(5e-5, 5e-5), segment_ids=segment_ids(T, STARTS))


def test_api_segments_every_impl_and_checks():
    """Through the public API every implementation gives the same result; all-zero ids are no documents at all
    (bit for bit with ``None`` on the XLA form); malformed ids are refused."""
    _, inputs, _ = inputs_for("gdn", 3, B=2, T=20)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    seg = segment_ids(20, [[4, 9], [16]])
    outs = {impl: api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=inputs["initial_state"],
                                             output_final_state=True,
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
