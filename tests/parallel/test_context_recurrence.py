"""The context-parallel recurrences (``hybrid_jax.parallel.recurrence``) against the token-by-token ground truth
(``kernels.reference.naive_recurrence``) on the whole sequence: GDN, KDA and GLA (Mamba2's SSD) over 4 shards, with
an initial state, the final state, grouped value heads and packed documents whose boundaries fall on, just before
and just after shard edges (and none); outputs, final states and the gradients of every input, the initial state
included; in XLA and with the Pallas kernels (interpreted: the two-pass op, ``kernels/recurrent/context.py``, on
shards of 8 tokens, ragged against its chunk of 16, and on 2 shards of 64 tokens, whose state passes run their 4
chunks as 4 groups side by side, documents starting on and around the groups' edges; with the fallback tables, with
them in V tiles of 16 and with sm90's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from hybrid_jax import kernels
from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.recurrent import context
from hybrid_jax.kernels.reference import naive_recurrence
from hybrid_jax.parallel import recurrence
from tests.conftest import rel_err

B, H, HV, K, V = 2, 1, 2, 8, 4
T, N = 32, 4  # shards of 8 tokens: edges at 8, 16, 24
STARTS = ((8, 15, 17, 24, 25), (3, 7, 16, 25))  # document starts per row: on, just before, just after edges
# 2 shards of 64 tokens (edge at 64), each 4 chunks of 16 (the groups' edges at 16, 32, 48 in each shard)
LONG = (128, 2, ((16, 33, 63, 64, 97), (31, 48, 65, 80, 112)))
OPS = {  # name: (context-parallel function, per-key gate, delta rule)
    "gdn": (recurrence.chunk_gated_delta_rule, False, True),
    "kda": (recurrence.chunk_kda, True, True),
    "gla": (recurrence.chunk_simple_gla, False, False),
}


def inputs(name: str, T: int = T, decay: float = 1.0) -> dict[str, jax.Array]:
    """``decay`` scales the log gates (small: states carried across many tokens, transitions far from 0)."""
    _, per_key, delta = OPS[name]
    ks = jax.random.split(jax.random.PRNGKey(len(name)), 6)
    g = -decay * jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV, K) if per_key else (B, T, HV)))
    x = dict(q=jax.random.normal(ks[0], (B, T, H, K)), k=jax.random.normal(ks[1], (B, T, H, K)),
             v=jax.random.normal(ks[2], (B, T, HV, V)), g=g * (0.3 if per_key else 1.0),
             h0=jax.random.normal(ks[5], (B, HV, K, V)))
    if delta:
        x["beta"] = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    return x


def segment_ids(T: int = T, starts_per_row=STARTS) -> jax.Array:
    seg = np.zeros((B, T), np.int32)
    for row, starts in enumerate(starts_per_row):
        for s in starts:
            seg[row, s:] += 1
    return jnp.asarray(seg)


def reference(name: str, x: dict, seg):
    delta = OPS[name][2]
    return naive_recurrence(x["q"], x["k"], x["v"], x["g"], x.get("beta"), initial_state=x["h0"],
                            use_qk_l2norm=delta, segment_ids=seg)


def context_parallel(name: str, x: dict, seg, impl: str = "xla", shards: int = N):
    fn, _, delta = OPS[name]
    mesh = Mesh(np.asarray(jax.devices()[:shards]), ("context",))
    time, whole = PartitionSpec(None, "context"), PartitionSpec()

    def local(x, seg):
        gates = (x["g"], x["beta"]) if delta else (x["g"],)
        extra = dict(use_qk_l2norm=True) if delta else {}
        return fn(x["q"], x["k"], x["v"], *gates, axis="context", initial_state=x["h0"], output_final_state=True,
                  chunk_size=16, impl=impl, segment_ids=seg, **extra)

    specs = {key: whole if key == "h0" else time for key in x}
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, None if seg is None else time),
                         out_specs=(time, whole), check_vma=False)(x, seg)


@pytest.mark.parametrize("documents,impl,long,tables", [
    (True, "xla", False, None), (False, "xla", False, None),
    (True, "pallas_interpret", False, None),  # V tiles of 32: the pair's pass reads u padded to a tile
    (True, "pallas_interpret", True, "v_tiles_16"),  # V tiles of 16: the pair's pass reads u's tile alone
    (False, "pallas_interpret", True, "sm90"),  # its tables: KDA's output in the state pass, GDN's own V tiles
])
def test_context_parallel_recurrences_equal_the_token_scan(documents, impl, long, tables, monkeypatch):
    """``tables``: the launch tables (None: the fallback; an arch: its own; ``v_tiles_16``: the fallback in V tiles
    of 16)."""
    if tables == "v_tiles_16":
        for table in (tuning.RECURRENT, tuning.RECURRENT_KDA):
            monkeypatch.setitem(table, "fallback", dataclasses.replace(table["fallback"], block_v=16))
    elif tables is not None:
        monkeypatch.setattr(tuning, "current_arch", lambda: tables)
    length, shards, starts = LONG if long else (T, N, STARTS)
    if long:  # the extra passes run in groups (a small batch x heads, chunks to spare)
        assert context.group_count(length // shards // 16, B * HV) == 4
    seg = segment_ids(length, starts) if documents else None
    xs = {name: inputs(name, length, 0.03 if long else 1.0) for name in OPS}  # long: decay ~0.6 over a group
    weights = {name: (jax.random.normal(jax.random.PRNGKey(7), (B, length, HV, V)),
                      jax.random.normal(jax.random.PRNGKey(8), (B, HV, K, V))) for name in OPS}

    def results(run):
        def loss(xs):
            out = {name: run(name, x, seg) for name, x in xs.items()}
            total = sum(jnp.sum(o * weights[n][0]) + jnp.sum(f * weights[n][1]) for n, (o, f) in out.items())
            return total, out
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(xs)

    (_, want), want_grads = results(reference)
    (_, got), got_grads = results(lambda name, x, seg: context_parallel(name, x, seg, impl, shards))
    for name in OPS:
        for what, a, b in (("output", got[name][0], want[name][0]), ("final state", got[name][1], want[name][1])):
            assert rel_err(a, b) < 1e-5, f"{name} {what}: {rel_err(a, b):.2e}"
        for key in xs[name]:
            err = rel_err(got_grads[name][key], want_grads[name][key])
            assert err < 1e-5, f"{name} d{key}: {err:.2e}"


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_context_parallel_bfloat16_is_as_close_to_the_token_scan_as_one_device(impl):
    """bf16 inputs (float32 states): the split recurrences land as close to the float32 token scan as one device's
    kernel in bf16 does (XLA: the completion's bf16 rounding of ``M_t^T q_t`` costs no more than bf16's own), outputs,
    final states and gradients, with packed documents."""
    seg = segment_ids()
    plain = {"gdn": kernels.chunk_gated_delta_rule, "kda": kernels.chunk_kda, "gla": kernels.chunk_simple_gla}

    def one_device(name, x, seg):
        delta = OPS[name][2]
        gates = (x["g"], x["beta"]) if delta else (x["g"],)
        extra = dict(use_qk_l2norm=True) if delta else {}
        return plain[name](x["q"], x["k"], x["v"], *gates, initial_state=x["h0"], output_final_state=True,
                           chunk_size=16, impl=impl, segment_ids=seg, **extra)

    def results(run, name, x):
        w = jax.random.normal(jax.random.PRNGKey(7), (B, T, HV, V))

        def loss(x):
            o, f = run(name, x, seg)
            return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(f), (o, f)
        return jax.jit(jax.grad(loss, has_aux=True))(x)

    for name in OPS:
        x = inputs(name)
        low = {k: v if k == "h0" else v.astype(jnp.bfloat16) for k, v in x.items()}
        truth_grads, truth = results(reference, name, {k: v.astype(jnp.float32) for k, v in low.items()})
        for run in (one_device, lambda name, x, seg: context_parallel(name, x, seg, impl)):
            grads, out = results(run, name, low)
            errors = [rel_err(a, b) for a, b in zip(out, truth, strict=True)]
            errors += [rel_err(grads[k], truth_grads[k]) for k in x]
            if run is one_device:
                bound = [2 * e + 1e-3 for e in errors]
            else:
                assert all(e <= b for e, b in zip(errors, bound, strict=True)), (name, errors, bound)
        assert max(errors) < 5e-2, (name, errors)
