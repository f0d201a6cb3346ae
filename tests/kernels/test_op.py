"""The recurrent op end to end (``kernels/recurrent/op.py``: the custom_vjp op and its XLA glue): the Pallas kernels in
interpret mode against the token-by-token recurrence and the chunked XLA form, values and every input's gradient,
at ragged T, grouped value heads, bf16, steep gates; the gate's chunk sums; the chunk size rules; causality; the
batch split under a mesh."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from hybrid_jax.kernels import recurrent, tuning
from hybrid_jax.kernels.recurrent import chunk_recurrence, op
from hybrid_jax.kernels.recurrent.launch import far_chunks
from hybrid_jax.kernels.tooling.calls import call, fwd_bwd
from tests.kernels.conftest import PALLAS, check, make_inputs, problem, rel_rms, steep_gates, value_and_grads


@pytest.mark.parametrize("kind, T, chunk", [("gdn", 37, 16), ("gla", 37, 16), ("kda", 45, 32)])
def test_float32_ragged_grouped_with_states(kind, T, chunk):
    """Two value heads per q/k head, T not a multiple of the chunk, an initial state and the final state (KDA at chunk
    32: two 16-row blocks per chunk, the factored off-diagonal and the exact diagonal blocks)."""
    p = problem(kind, B=2 if kind != "kda" else 1, T=T, chunk=chunk)
    check(p, *make_inputs(p, 0))


@pytest.mark.parametrize("kind", ["gdn", "gla", "kda"])
def test_float32_shorter_than_chunk_no_states(kind):
    p = problem(kind, B=1, T=11, H=2, HV=2)
    check(p, *make_inputs(p, 1, init=False))


def test_float32_chunk32_wide_keys():
    """Chunk 32 (three levels of the block-doubling inverse), K > V, T a multiple of the chunk."""
    p = problem("gdn", B=1, T=64, K=32, V=16, chunk=32)
    check(p, *make_inputs(p, 2))


@pytest.mark.parametrize("kind, T, chunk", [("gdn", 37, 16), ("gla", 37, 16), ("kda", 45, 32)])
def test_bfloat16(kind, T, chunk):
    """bf16 inputs against the float32 token-by-token recurrence (``TOLERANCE["bfloat16"]``)."""
    p = problem(kind, B=2 if kind != "kda" else 1, T=T, dtype="bfloat16", chunk=chunk)
    check(p, *make_inputs(p, 3), refs=("naive",))


@pytest.mark.parametrize("kind", ["gdn", "gla"])
def test_strongly_negative_gates(kind):
    """Gates down to -20 per step: chunk-level decays underflow to zero, never overflow."""
    p = problem(kind, T=40)
    x, ct = make_inputs(p, 4)
    check(p, steep_gates(x, -20.0, 4), ct)


@pytest.mark.parametrize("chunk", [32, 64])
def test_kda_strongly_negative_gates(chunk):
    """Gates down to -20 per step and per channel (a span of 640 in a chunk of 32), and -1000 on some (step,
    channel) pairs as in FLA's stress test: no overflow or NaN, same values and gradients. Chunk 64: four 16-row
    blocks, pairs up to three blocks apart."""
    p = problem("kda", B=1, T=40 if chunk == 32 else 72, chunk=chunk)
    x, ct = make_inputs(p, 16)
    x = steep_gates(x, -20.0, 16)
    check(p, dict(x, g=x["g"].at[:, 5::11, :, ::3].set(-1000.0)), ct)


@pytest.mark.parametrize("chunk, fall_row", [(16, 20), (32, 8)])
def test_kda_one_reference_fallback_end_to_end(chunk, fall_row):
    """Values and gradients on a gate that falls by 100 at one row (every launch's fallback runs). Chunk 32, row 8:
    the first of two blocks falls, and the second block's rows, though their own gate is mild, must be redone too, as
    ``T`` carries the first block's wrong rows into them."""
    p = problem("kda", B=1, T=48, chunk=chunk)
    x, ct = make_inputs(p, 17)
    check(p, dict(x, g=x["g"].at[:, fall_row].add(-100.0)), ct)


@pytest.mark.parametrize("case", ["steep-fused", "falling-split", "with-output-in-state"])
def test_kda_gate_sums_in_kernels(case, monkeypatch):
    """``gate_cumsum_in_kernels``: the kernels take the raw gate, sum each chunk themselves and return the raw gate's
    gradient: the same values and gradients. Gates down to -20 per step with -1000 entries (fused gradient pass); a
    gate falling by 100 at row 20, so that the levels launches redo a chunk (split gradient pass: the reverse sum
    in the second launch); and with the output computed in the forward state pass. XLA's chunk cumsum is not called."""
    p = problem("kda", B=1, T=37, K=16, V=16)
    x, ct = make_inputs(p, 22)
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), gate_cumsum_in_kernels=True,
                                 split_grad_from=None if case == "steep-fused" else 0)
    if case == "steep-fused":
        x = steep_gates(x, -20.0, 22)
        x = dict(x, g=x["g"].at[:, 5::11, :, ::3].set(-1000.0))
    else:
        x = dict(x, g=x["g"].at[:, 20].add(-100.0))
        config = dataclasses.replace(config, output_in_state=case == "with-output-in-state")
    check(p, x, ct, config=config)

    def xla_cumsum(*_):
        raise AssertionError("XLA's chunk cumsum was called")

    monkeypatch.setattr(op, "chunk_local_cumsum", xla_cumsum)
    without = dataclasses.replace(config, gate_cumsum_in_kernels=False)
    jax.make_jaxpr(lambda x: call(p, x, PALLAS, config=config))(x)
    with pytest.raises(AssertionError, match="chunk cumsum"):  # without the option it is called
        jax.make_jaxpr(lambda x: call(p, x, PALLAS, config=without))(x)


def test_kda_gate_sums_in_kernels_flags_and_chunk():
    """Where the kernels sum the gate, XLA flags the chunks for the levels launches from the raw gate: the same
    chunks as from the cumulated gate for a gate <= 0, and at least those for a gate of either sign; at chunks
    other than 16 XLA sums the gate, as without the option."""
    g = jax.random.uniform(jax.random.PRNGKey(23), (2, 64, 3, 32), minval=-0.5, maxval=0.0)
    g = g.at[0, 16:32, 1, 3].set(-1.0).at[1, 40:48, 2, 20].set(-2.0)  # two chunks move by 15 and 16 in one channel
    for gate in (g, g.at[:, 1::2].multiply(-1.0)):
        cumulated = far_chunks(recurrent.chunk_local_cumsum(gate, 16), 8.0, 16)
        raw = far_chunks(gate, 8.0, 16, cumulated=False)
        assert np.all(np.asarray(raw) >= np.asarray(cumulated))
        if gate is g:
            assert float(cumulated.sum()) == 2  # the two steep chunks
            np.testing.assert_array_equal(np.asarray(raw), np.asarray(cumulated))
        else:  # rows of alternating sign cancel in the sums, not in the bound
            assert float(raw.sum()) > float(cumulated.sum())
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), gate_cumsum_in_kernels=True)
    assert recurrent.kernel_gate(g, 16, config) is g
    np.testing.assert_array_equal(np.asarray(recurrent.kernel_gate(g, 32, config)),  # other chunks: XLA sums
                                  np.asarray(recurrent.chunk_local_cumsum(g, 32)))
    scalar = g[..., 0]  # the scalar gate keeps XLA's cumsum
    np.testing.assert_array_equal(np.asarray(recurrent.kernel_gate(scalar, 32, config)),
                                  np.asarray(recurrent.chunk_local_cumsum(scalar, 32)))


def test_kda_gate_sums_option_at_another_chunk():
    """A config with ``gate_cumsum_in_kernels`` (as the sm90 KDA table has) at a chunk the caller picks other than
    16: XLA sums the gate, and values and gradients are right."""
    p = problem("kda", B=1, T=37, K=16, V=16, chunk=32)
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), gate_cumsum_in_kernels=True,
                                 output_in_state=True)
    check(p, *make_inputs(p, 24), config=config)


@pytest.mark.parametrize("chunk, options", [(32, {}), (32, {"output_in_state": True}),
                                           (16, {"output_in_state": True, "gate_cumsum_in_kernels": True})],
                         ids=["output-launch", "output-in-state", "gate-sums-in-kernels"])
def test_kda_outputs_do_not_depend_on_later_gates(chunk, options):
    """o[:, :t+1] is bit-identical when every gate after t changes (within t's sub-chunk, chunk and later); also with
    the output computed in the forward state pass, and with the gate summed in the kernels."""
    p = problem("kda", B=1, T=40, chunk=chunk)
    x, _ = make_inputs(p, 14)
    config = dataclasses.replace(tuning.recurrent_config(per_key=True), **options)
    fn = jax.jit(lambda g: call(p, dict(x, g=g), PALLAS, config=config)[0])
    t = 20  # row 4 of the second sub-chunk (at chunk 16: chunk) of the first chunk
    g_later = jax.random.uniform(jax.random.PRNGKey(15), x["g"].shape, minval=-30.0, maxval=0.0)
    o, o_p = fn(x["g"]), fn(x["g"].at[:, t + 1:].set(g_later[:, t + 1:]))
    np.testing.assert_array_equal(np.asarray(o[:, : t + 1]), np.asarray(o_p[:, : t + 1]))
    assert rel_rms(o_p[:, t + 1:], o[:, t + 1:]) > 1e-2  # the later outputs do see the change


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("per_key", [False, True], ids=["scalar", "per-key"])
def test_chunk_local_cumsum_and_its_vjp(per_key, chunk):
    """The gate's cumulative sum restarts at every chunk; its VJP is the reverse cumulative sum per chunk (a per-key
    gate's chunk of 32 or 64 is summed in blocks of 16 and offset by the earlier blocks' totals)."""
    g = jax.random.normal(jax.random.PRNGKey(20), (2, 192, 3, 8) if per_key else (2, 192, 3))
    ct = jax.random.normal(jax.random.PRNGKey(21), g.shape)
    out, vjp = jax.vjp(lambda x: recurrent.chunk_local_cumsum(x, chunk), g)
    chunks = np.asarray(g).reshape(2, 192 // chunk, chunk, *g.shape[2:])
    np.testing.assert_allclose(out, np.cumsum(chunks, axis=2).reshape(g.shape), rtol=1e-6, atol=1e-5)
    rev = np.flip(np.cumsum(np.flip(np.asarray(ct).reshape(chunks.shape), 2), axis=2), 2)
    np.testing.assert_allclose(vjp(ct)[0], rev.reshape(g.shape), rtol=1e-6, atol=1e-5)
    t = chunk + 20  # the second chunk's row 20: its sum reads no later row, to the bit
    later = jax.jit(lambda x: recurrent.chunk_local_cumsum(x, chunk))(g.at[:, t + 1:].multiply(1e3))
    np.testing.assert_array_equal(np.asarray(later[:, : t + 1]), np.asarray(out[:, : t + 1]))


def test_rejects_bad_chunk_size():
    x, _ = make_inputs(problem(B=1, T=8), 6)
    with pytest.raises(ValueError, match="power of two"):
        chunk_recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=24, interpret=True)


@pytest.mark.parametrize("per_key", [False, True])
def test_chunk_size_none_takes_the_configs_chunk(per_key):
    """``chunk_size=None`` runs at ``config.chunk`` (the same program as passing it: the same bits), another chunk is
    another program, and the default config is the gate kind's table entry: chunk 64 for GDN/GLA, 16 for KDA."""
    x, _ = make_inputs(problem("kda" if per_key else "gdn", B=1, T=40), 16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    program = lambda **kw: str(jax.make_jaxpr(  # noqa: E731
        lambda *a: chunk_recurrence(*a, use_qk_l2norm=True, interpret=True, **kw)[0])(*args))
    cfg = tuning.RecurrentConfig(chunk=32)
    assert program(config=cfg) == program(config=cfg, chunk_size=32) != program(config=cfg, chunk_size=16)
    default = 16 if per_key else 64
    assert tuning.recurrent_config(per_key=per_key).chunk == default
    assert program() == program(chunk_size=default)


def test_runs_per_batch_shard_under_a_mesh():
    """Under ``jax.set_mesh`` the kernels run on each device's batch shard (XLA cannot partition Pallas calls)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    p = problem(B=8, T=20)
    x, ct = make_inputs(p, 7)
    (o, ht), grads = value_and_grads(p, x, ct)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    shard = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    x_s, ct_s = jax.device_put((x, ct), shard)
    with jax.set_mesh(mesh):
        fn = jax.jit(fwd_bwd(p, PALLAS))
        assert "shard_map" in str(jax.make_jaxpr(fn)(x_s, ct_s))
        (o_s, ht_s), grads_s = fn(x_s, ct_s)
    assert o_s.sharding.spec == PartitionSpec(("data", "fsdp"))
    assert rel_rms(o_s, o) <= 1e-6 and rel_rms(ht_s, ht) <= 1e-6
    for name in grads:
        assert rel_rms(grads_s[name], grads[name]) <= 1e-6, name
