"""The launch search space beside the recurrent kernels (``kernels/recurrent/search.py``)."""

from benchmarks.shapes import SHAPES
from hybrid_jax.kernels.recurrent.search import LAUNCHES, search_space
from hybrid_jax.kernels.tuning import RecurrentConfig


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
    assert [a.field for a in search_space(split, [s for s in SHAPES if s.name == "ssd_anchor"])] == fields
