"""The public functions (``kernels/api.py``) dispatch through the op table (``kernels/registry.py``): each ``impl``
reaches its implementation with every argument passed on; ``auto`` is XLA on CPU; bad impls are clear errors. (Values
through the public functions: every op test calls them, ``kernels/tooling/calls.py``.)"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from hybrid_jax import kernels
from hybrid_jax.kernels import tuning, tuning_file
from hybrid_jax.kernels.registry import OPS, recurrent_op
from tests.kernels.conftest import make_inputs, problem


def spy(monkeypatch, op: str, impl: str, result) -> dict:
    """Replace ``OPS[op]``'s ``impl`` by a function that records its arguments and returns ``result``."""
    seen = {}

    def record(*args, **kw):
        seen.update(args=args, kw=kw)
        return result

    monkeypatch.setitem(OPS[op].implementations, impl, record)
    return seen


@pytest.mark.parametrize("impl", ["naive", "xla", "pallas", "pallas_interpret", "auto"])
@pytest.mark.parametrize("op", ["gdn", "kda", "gla"])
def test_recurrent_functions_dispatch_through_the_registry(monkeypatch, op, impl):
    p = problem(op, B=1, T=8)
    x, _ = make_inputs(p, 0)
    seen = spy(monkeypatch, op, "xla" if impl == "auto" else impl, ("o", "final"))
    seg = jnp.zeros((1, 8), jnp.int32)
    fn = getattr(kernels, OPS[op].function)
    args = [x[n] for n in ("q", "k", "v", "g", "beta") if n in x]
    kw = dict(scale=0.5, initial_state=x["initial_state"], chunk_size=32, impl=impl, segment_ids=seg,
              **({"use_qk_l2norm": True} if p.delta else {}))
    assert fn(*args, output_final_state=True, **kw) == ("o", "final")
    assert all(a is b for a, b in zip(seen["args"], [*args, None] if op == "gla" else args, strict=True))
    assert seen["kw"] == dict(scale=0.5, initial_state=x["initial_state"], use_qk_l2norm=p.delta, chunk_size=32,
                              segment_ids=seg)
    assert fn(*args, **kw) == ("o", None)  # no final state unless asked


@pytest.mark.parametrize("impl", ["naive", "xla", "pallas_interpret", "auto"])
def test_attention_dispatches_through_the_registry(monkeypatch, impl):
    x, _ = make_inputs(problem("attention", B=1, T=8, H=2, HV=2), 0)
    seen = spy(monkeypatch, "attention", "xla" if impl == "auto" else impl, "o")
    assert kernels.attention(x["q"], x["k"], x["v"], causal=False, scale=0.5, impl=impl) == "o"
    assert seen["kw"] == dict(causal=False, scale=0.5, segment_ids=None, q_offset=None)
    # queries at an offset in the keys' sequence (a context shard's): the offset is handed on as given
    assert kernels.attention(x["q"][:, :3], x["k"], x["v"], scale=0.5, impl=impl, q_offset=2) == "o"
    assert seen["kw"] == dict(causal=True, scale=0.5, segment_ids=None, q_offset=2)


def test_bad_impls_are_clear_errors(monkeypatch):
    x, _ = make_inputs(problem("gla", B=1, T=8), 0)
    with pytest.raises(ValueError, match="chunk_simple_gla: impl must be one of"):
        kernels.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], impl="cuda")
    monkeypatch.delitem(OPS["gla"].implementations, "naive")
    with pytest.raises(NotImplementedError, match="impl='naive' is not available"):
        kernels.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], impl="naive")


def test_registry_is_the_one_op_map():
    """Every op with its public function, gate kind, implementations, table and search space; the tuning files' op
    names and the gate kind -> op lookup come from it."""
    assert set(OPS) == {"gdn", "kda", "gla", "attention"}
    assert {n: OPS[n].function for n in OPS} == {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda",
                                                 "gla": "chunk_simple_gla", "attention": "attention"}
    assert all(callable(getattr(kernels, op.function)) for op in OPS.values())
    assert OPS["kda"].config("sm90").chunk == 16 and OPS["gdn"].config("sm90").chunk == 64
    for name in OPS:
        assert {"naive", "xla", "pallas", "pallas_interpret"} == set(OPS[name].implementations)
    assert set(OPS["attention"].search_space()) == {"fwd", "dkdv", "dq"}
    assert OPS["attention"].config("sm90", head_dim=64).fwd.block_q == 64
    assert [recurrent_op(per_key, delta) for per_key, delta in ((True, True), (False, True), (False, False))] == \
        ["kda", "gdn", "gla"] == [tuning.recurrent_op(k, d) for k, d in ((True, True), (False, True), (False, False))]
    assert tuning_file.OPS == ("gdn", "kda", "gla")
