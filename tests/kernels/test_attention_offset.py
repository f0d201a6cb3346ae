"""Flash attention of queries at an offset in a longer key sequence (a context shard's queries over the whole
sequence's keys: ``q_offset``, traced), interpreted on CPU: values and the three gradients against the float32
reference (``reference.naive_attention`` with the offset) and against plain self-attention over the whole sequence
cut to the query rows; ragged lengths, offsets on and off block edges, documents whose boundaries fall before, at and
after the offset; key blocks past the causal limit are never visited; traced offset 0 is the self-attention path; it
lowers to Triton."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.kernels import flash_attention as flash
from hybrid_jax.kernels import reference, tuning
from hybrid_jax.kernels.tooling.errors import Tolerance
from hybrid_jax.kernels.tooling.lowering import TARGETS, TRITON_CALL, lower
from tests.kernels.conftest import TOLERANCE, rel_rms, segment_ids

# Several blocks per sequence, a different tiling in each kernel.
TILES = tuning.AttentionConfig(fwd=tuning.AttentionKernel(32, 16), dkdv=tuning.AttentionKernel(16, 32),
                               dq=tuning.AttentionKernel(16, 16))
# Document starts per row: row 0 before (17, 31), at (40) and after (50) the offset 40, and one past the last query
# (70, keys only); row 1 just before (39) and just after (41) it.
DOCS = [[17, 31, 40, 50, 70], [39, 41]]


def arrays(Tq: int, Tk: int, dqk: int, dv: int, dtype, seed: int = 0):
    """``(q [2,Tq,2,dqk], k [2,Tk,2,dqk], v [2,Tk,2,dv], do [2,Tq,2,dv])`` normal, in ``dtype``."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k = jax.random.normal(ks[0], (2, Tq, 2, dqk)), jax.random.normal(ks[1], (2, Tk, 2, dqk))
    v, do = jax.random.normal(ks[2], (2, Tk, 2, dv)), jax.random.normal(ks[3], (2, Tq, 2, dv))
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def run(fn, q, k, v, do, offset):
    """``(o, dq, dk, dv)`` of ``fn(q, k, v, offset)`` under ``jit`` with the offset a traced int32 scalar."""
    def go(q, k, v, do, offset):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, offset), q, k, v)
        return (o, *vjp(do))

    return jax.jit(go)(q, k, v, do, jnp.int32(offset))


def whole(q, k, v, offset, *, causal, segment_ids):
    """Self-attention over the whole key sequence with ``q`` as its rows ``[offset, offset + Tq)`` (the other rows'
    queries zero), cut to those rows: what the offset must compute, without any offset in the reference."""
    q_all = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(k.shape[:3] + q.shape[3:], q.dtype), q, offset, axis=1)
    o = reference.naive_attention(q_all, k, v, causal=causal, segment_ids=segment_ids)
    return jax.lax.dynamic_slice_in_dim(o, offset, q.shape[1], axis=1)


CASES = [  # Tq, Tk, offset, Dqk, Dv, dtype, causal, documents
    pytest.param(24, 77, 40, 24, 16, "float32", True, True, id="Tq24-Tk77-at40-docs-causal"),
    pytest.param(24, 77, 40, 24, 16, "float32", False, True, id="Tq24-Tk77-at40-docs-full"),
    pytest.param(24, 77, 0, 24, 16, "float32", True, True, id="Tq24-Tk77-at0-docs"),
    pytest.param(37, 77, 40, 24, 16, "float32", True, False, id="Tq37-Tk77-last-rows"),
    pytest.param(33, 100, 13, 48, 32, "float32", True, False, id="Tq33-Tk100-at13"),
    pytest.param(33, 100, 50, 64, 64, "bfloat16", True, True, id="Tq33-Tk100-at50-bf16-docs"),
]


@pytest.mark.parametrize("Tq,Tk,offset,dqk,dv,dtype,causal,docs", CASES)
def test_offset_matches_reference_and_whole_attention(Tq, Tk, offset, dqk, dv, dtype, causal, docs):
    q, k, v, do = arrays(Tq, Tk, dqk, dv, jnp.dtype(dtype))
    seg = segment_ids(Tk, DOCS) if docs else None
    got = run(lambda q, k, v, o: flash.flash_attention(q, k, v, causal=causal, config=TILES, interpret=True,
                                                       segment_ids=seg, q_offset=o), q, k, v, do, offset)
    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, do))
    ref = run(lambda q, k, v, o: reference.naive_attention(q, k, v, causal=causal, segment_ids=seg, q_offset=o),
              *f32, offset)
    direct = run(lambda q, k, v, o: whole(q, k, v, o, causal=causal, segment_ids=seg), *f32, offset)
    tol = Tolerance(1e-5, 1e-5) if dtype == "float32" else TOLERANCE[dtype]
    for name, g, r, d in zip(("o", "dq", "dk", "dv"), got, ref, direct, strict=True):
        assert g.dtype == jnp.dtype(dtype) and g.shape == r.shape, name
        assert rel_rms(r, d) <= 1e-6, (name, "reference vs whole attention", rel_rms(r, d))
        assert rel_rms(g, r) <= tol.of(name), (name, rel_rms(g, r))


def test_keys_past_the_causal_limit_are_skipped():
    """Queries at 16..47 over 100 keys, key tiles of 16 (forward, dQ): the keys from 48 on are in blocks that no
    query block visits, so NaN there changes nothing (the plain mask would multiply it by zero probabilities). The
    dK/dV programs of 32 keys from 64 on visit no query block: their gradients are zero."""
    q, k, v, do = arrays(32, 100, 24, 16, jnp.float32, seed=1)
    fn = lambda q, k, v, o: flash.flash_attention(q, k, v, config=TILES, interpret=True, q_offset=o)  # noqa: E731
    clean = run(fn, q, k, v, do, 16)
    nan = run(fn, q, k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan), do, 16)
    for name, a, b in zip(("o", "dq"), clean[:2], nan[:2], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    for name, a, b in zip(("dk", "dv"), clean[2:], nan[2:], strict=True):
        np.testing.assert_array_equal(a[:, :48], b[:, :48], err_msg=name)
        assert not np.asarray(b[:, 64:]).any(), name
    assert np.isnan(np.asarray(reference.naive_attention(q, k, v.at[:, 48:].set(jnp.nan), q_offset=16))).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_keys_of_documents_before_the_queries_visit_no_query_block(causal):
    """Queries at 40..63 of 77 keys with :data:`DOCS`: the dK/dV program of keys 0..31 (both rows' documents there
    end before 40) visits no query block, so NaN in every query and output gradient leaves its dk, dv exactly zero."""
    q, k, v, do = arrays(24, 77, 24, 16, jnp.float32, seed=3)
    fn = lambda q, k, v, o: flash.flash_attention(q, k, v, causal=causal, config=TILES, interpret=True,  # noqa: E731
                                                  segment_ids=segment_ids(77, DOCS), q_offset=o)
    _, _, dk, dv = run(fn, jnp.full_like(q, jnp.nan), k, v, jnp.full_like(do, jnp.nan), 40)
    for name, g in (("dk", dk), ("dv", dv)):
        assert not np.asarray(g[:, :32]).any() and np.isnan(np.asarray(g[:, 40:64])).all(), name


@pytest.mark.parametrize("docs", [False, True], ids=["plain", "docs"])
def test_traced_offset_zero_is_self_attention(docs):
    """A traced offset of 0 with ``Tq == Tk`` takes the offset kernels; they visit the same blocks with the same masks
    as self-attention's, so the values and gradients are bit for bit those of the static path."""
    q, k, v, do = arrays(77, 77, 24, 16, jnp.float32, seed=2)
    seg = segment_ids(77, DOCS) if docs else None
    fn = lambda q, k, v, o: flash.flash_attention(q, k, v, config=TILES, interpret=True, segment_ids=seg,  # noqa: E731
                                                  q_offset=o)
    static = run(lambda q, k, v, o: fn(q, k, v, None), q, k, v, do, 0)
    for name, a, b in zip(("o", "dq", "dk", "dv"), static, run(fn, q, k, v, do, 0), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_bad_offsets_are_clear_errors():
    q, k, v, _ = arrays(8, 20, 16, 16, jnp.float32)
    with pytest.raises(ValueError, match="8 queries at offset 13 do not lie within 20 keys"):
        flash.flash_attention(q, k, v, interpret=True, q_offset=13)
    for bad_k in (k[:, :, :1], k[..., :8]):  # another head count, another qk head dim
        with pytest.raises(ValueError, match="need q"):
            flash.flash_attention(q, bad_k, v, interpret=True)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_offset_kernels_lower_to_triton(arch):
    """Forward + backward with a traced offset and documents (every optional operand), at a 1B MLA-like head dim."""
    S = jax.ShapeDtypeStruct
    config = tuning.attention_config(arch, 128)

    def loss(q, k, v, offset, seg):
        o = flash.flash_attention(q, k, v, config=config, segment_ids=seg, q_offset=offset)
        return o.astype(jnp.float32).sum()

    args = (S((1, 256, 2, 96), jnp.bfloat16), S((1, 1024, 2, 96), jnp.bfloat16), S((1, 1024, 2, 64), jnp.bfloat16),
            S((), jnp.int32), S((1, 1024), jnp.int32))
    assert lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), args, arch).count(TRITON_CALL) >= 3
