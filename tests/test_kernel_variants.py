"""benchmarks/kernels.py's ``--variant`` syntax: fields of the recurrent-kernel config and of one kernel's launch."""

import pytest

from benchmarks.kernels import apply_variant
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig


def test_apply_variant_sets_config_and_launch_fields():
    cfg = RecurrentConfig(block_k=64, grad=Launch(8, 1))
    out = apply_variant(cfg, "chunk=32,grad.num_stages=2,block_k=none,decay_operands_f32=true")
    assert out.chunk == 32 and out.block_k is None and out.decay_operands_f32
    assert out.grad == Launch(8, 2) and out.wy == cfg.wy and out.state == cfg.state


def test_apply_variant_rejects_unknown_fields():
    with pytest.raises(TypeError):
        apply_variant(RecurrentConfig(), "grad.warps=4")
    with pytest.raises(TypeError):
        apply_variant(RecurrentConfig(), "chunks=32")


def test_autotune_sweeps_the_fields_asked_for_in_that_order():
    from benchmarks.autotune import FIELDS, sweep
    from benchmarks.shapes import SHAPES

    kda = [s for s in SHAPES if s.name == "kda_anchor"]
    split = RecurrentConfig(split_grad_from=0)
    assert [f[0] for f in sweep(split, kda)] == list(FIELDS)
    assert "grad_wy" not in [f[0] for f in sweep(RecurrentConfig(), kda)]  # fused gradient pass: no second launch
    assert [f[0] for f in sweep(split, kda, ["grad_wy", "block_v_bwd", "state"])] == ["grad_wy", "block_v_bwd", "state"]
    _, values, stages = sweep(split, kda, ["block_v_bwd"])[0]
    assert None in values and stages == ("state_bwd",)
