"""The launch search space beside the recurrent kernels, and the config override syntax sweeps and variants use."""

import pytest

from benchmarks.shapes import SHAPES
from hybrid_jax.kernels.recurrent.search import LAUNCHES, search_space
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig, override


def test_override_sets_config_and_launch_fields():
    cfg = RecurrentConfig(block_v_bwd=16, grad=Launch(8, 1))
    out = override(cfg, "chunk=32,grad.num_stages=2,block_v_bwd=none,output_in_state=true")
    assert out.chunk == 32 and out.block_v_bwd is None and out.output_in_state
    assert out.grad == Launch(8, 2) and out.wy == cfg.wy and out.state == cfg.state


@pytest.mark.parametrize("text", ["grad.warps=4", "chunks=32", "block_k=64", "chunk.num_warps=4", "chunk=big"])
def test_override_rejects_unknown_fields_and_values(text):
    with pytest.raises(ValueError, match="unknown config field|must be an integer"):
        override(RecurrentConfig(), text)


def test_search_space_order_and_the_second_gradient_launch():
    kda = [s for s in SHAPES if s.name == "kda_anchor"]
    split = RecurrentConfig(split_grad_from=0)
    fields = ["block_v", "block_v_bwd", "wy", "state", "output", "state_bwd", "grad"]
    assert [a.field for a in search_space(split, kda)] == fields + ["grad_wy"]
    assert [a.field for a in search_space(RecurrentConfig(), kda)] == fields  # fused gradient pass: no second launch
    axes = {a.field: a for a in search_space(split, kda)}
    assert None in axes["block_v_bwd"].values and axes["block_v_bwd"].stages == ("state_bwd",)
    assert axes["grad_wy"].values == LAUNCHES and axes["grad_wy"].stages == ("grad",)
    assert len(set(LAUNCHES)) == 9


def test_registry_has_every_op_with_its_table_and_search_space():
    assert set(OPS) == {"gdn", "kda", "gla", "attention"}
    assert OPS["kda"].config("sm90").chunk == 16 and OPS["gdn"].config("sm90").chunk == 64
    for name in ("gdn", "kda", "gla"):
        assert {"naive", "xla", "pallas", "pallas_interpret"} <= set(OPS[name].implementations)
    assert set(OPS["attention"].search_space()) == {"fwd", "dkdv", "dq"}
    assert OPS["attention"].config("sm90", head_dim=64).fwd.block_q == 64
