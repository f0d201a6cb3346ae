"""Learning-rate schedule, the weight-decay rule, FLOPs per token and peak FLOP/s lookup."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.flops import flops_per_token, peak_flops
from hybrid_jax.model import HybridLM, count_params
from hybrid_jax.train.step.optim import decay_mask, learning_rate_schedule
from tests.conftest import load_config
from tests.train.common import tiny_config


def test_schedule_warmup_from_zero_then_cosine_to_min_lr():
    t = tiny_config(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4).train
    lr = learning_rate_schedule(t)
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose(float(lr(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(lr(55)), 1e-4 + 0.5 * 9e-4, rtol=1e-5)  # cosine midpoint
    np.testing.assert_allclose(float(lr(100)), 1e-4, rtol=1e-6)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_weight_decay_on_matrices_only():
    config = load_config("demo")  # every sublayer kind
    model = nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mask = decay_mask(params)
    leaves = zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(mask), strict=True)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): (leaf, decay) for (path, leaf), decay in leaves}
    assert flat["embed/embedding"][1]
    for name, (leaf, decay) in flat.items():
        last = name.split("/")[-1]
        if last in ("A_log", "dt_bias", "D") or "norm" in name or last == "bias":
            assert not decay, name
        if last == "kernel":
            assert decay, name
        assert decay == (len(leaf.shape) >= 2 and last not in ("A_log", "dt_bias", "D")), name


def test_flops_per_token():
    c = tiny_config().model
    c.update(dict(pattern="-", hidden_size=32, ffn_size=64, vocab_size=256))
    d, f, v = 32, 64, 256
    assert flops_per_token(c, 128) == 3 * (2 * (d * 2 * f + f * d) + 2 * v * d)  # SwiGLU + tied head
    c.tie_embeddings = False  # an untied lm_head is the same head: counted once, not as one more matrix
    assert flops_per_token(c, 128) == 3 * (2 * (d * 2 * f + f * d) + 2 * v * d)
    c.tie_embeddings = True

    c.pattern = "*-"
    m = c.mla
    per_t = 3 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)  # causal half
    assert flops_per_token(c, 200) - flops_per_token(c, 100) == pytest.approx(100 * per_t)

    big = load_config("zebra_300m_gdn").model  # nearly all parameters are matrices: close to 6N, not 1.9 x 6N
    ratio = flops_per_token(big, 2048) / (6 * count_params(big))
    assert 1.0 < ratio < 1.05


@pytest.mark.parametrize(
    "kind,peak",
    [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("AMD Instinct MI300X", 1307e12),
     ("AMD Instinct MI355X", 2300e12), ("cpu", None)],
)
def test_peak_flops(kind, peak):
    assert peak_flops(SimpleNamespace(device_kind=kind)) == peak
