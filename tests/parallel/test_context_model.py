"""The whole model with each sequence split over a ``context`` mesh axis equals one device: the tiny hybrid with
every sublayer kind (MLA, GDN, KDA, Mamba2, MLP), float32, B = 2, packed documents whose boundaries fall on, just
before and just after the shard edges, RoPE positions restarting per document; context 4 alone and data 2 x context 4
(with every sublayer rematerialised; also with every kernel in its Pallas form, interpreted, on shards of two
chunks, whose recurrences then run as two groups side by side), through the train step's ``batch_loss`` (which
takes the context path under such a mesh). The paths without segment ids:
``test_context_step.py`` and ``test_context_recurrence.py``."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.model import HybridLM
from hybrid_jax.train.step import mesh as mesh_lib
from hybrid_jax.train.step.train_step import batch_loss
from tests.conftest import load_config

T = 32  # 4 shards of 8 tokens: edges at 8, 16, 24
# document starts per row: on an edge (8), just before (15) and just after (17) one, then a one-token document
# on the last shard (24, 25); row 1: starts at 3, 7 (just before an edge), 16 (on one) and 25
STARTS = ((8, 15, 17, 24, 25), (3, 7, 16, 25))
# 4 shards of 32 tokens (2 chunks of 16 each: the groups' edges at 16, 48, 80, 112), starts on and around both edges
LONG = (128, ((16, 31, 32, 33, 64, 97), (15, 48, 65, 96, 112)))


def tiny_config():
    """The demo model with one sublayer of each kind, smaller."""
    c = load_config("demo")
    c.model.update(dict(pattern="*GKS-", num_layers=5, hidden_size=32, ffn_size=64, vocab_size=64, dtype="float32",
                        chunk_size=16, reset_positions=True))
    c.model.gdn.update(dict(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=8))
    c.model.kda.update(dict(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=8))
    c.model.mamba2.update(dict(state_dim=8, head_dim=8, num_groups=1, expand=1))
    c.model.mla.update(dict(num_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=8))
    return c


def batch(vocab: int, length: int = T, starts_per_row=STARTS) -> Batch:
    """``[2, length+1]`` random tokens and the segment ids of ``starts_per_row``."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (2, length + 1), dtype=np.int32)
    seg = np.zeros((2, length + 1), np.int32)
    for row, starts in enumerate(starts_per_row):
        for s in starts:
            seg[row, s:] += 1
    return Batch(tokens, seg)


_CACHE: dict = {}


def tiny_params() -> dict:
    """The parameters of :func:`tiny_config`'s model, seed 0 (made once per process: an eager init takes seconds)."""
    if "params" not in _CACHE:
        _CACHE["params"] = nnx.to_pure_dict(nnx.split(HybridLM(tiny_config().model, rngs=nnx.Rngs(0)), nnx.Param)[1])
    return _CACHE["params"]


def loss_and_grads(cfg, b: Batch, mesh: Mesh | None):
    """The loss and parameter gradients of ``batch_loss`` on ``b``, under ``mesh`` when given (the parameters of
    seed 0, whatever ``cfg.model.remat``)."""
    params = tiny_params()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
    step = jax.jit(jax.value_and_grad(lambda p, b: batch_loss(p, graphdef, b, chunk_size=24)))
    if mesh is None:
        return step(params, b)
    with jax.set_mesh(mesh):
        return step(params, b)


@pytest.mark.parametrize("data,impl,long", [(1, "xla", False), (2, "xla", False), (2, "pallas_interpret", True)])
def test_context_parallel_loss_and_grads_equal_one_device(data, impl, long):
    """Against one device with the same kernels: the float32 tolerance measures the context split, not the Pallas
    kernels' rounding against XLA's (each within 1e-7 of float64 per op, up to 1.5e-5 apart in ``dt_bias``'s
    gradient after the whole model; at most 3e-6 apart here)."""
    cfg = tiny_config()
    cfg.model.kernel_impl = impl
    b = batch(cfg.model.vocab_size, *LONG) if long else batch(cfg.model.vocab_size)
    key = ("reference", impl, long)
    if key not in _CACHE:
        _CACHE[key] = loss_and_grads(cfg, b, None)
    ref_loss, ref_grads = _CACHE[key]
    cfg.mesh.update(dict(data=data, context=4))
    if data == 2:
        cfg.model.remat = "full"
    mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[: 4 * data])
    loss, grads = loss_and_grads(cfg, b, mesh)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, want), got in zip(flat_ref, jax.tree.leaves(grads), strict=True):
        want, got = np.asarray(want), np.asarray(got)
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"
