"""MLA with each sequence split over 4 devices through the Pallas flash kernel (interpreted on CPU; each shard's
queries at ``q_offset = shard index x T/4``, traced) equals one device's MLA through the XLA softmax: the output and
the gradients of the input and of every parameter, float32, packed documents whose boundaries fall on, just before and
just after the shard edges, RoPE positions restarting per document (``test_context_model.py``'s tiny model and
documents; that test runs the XLA path of every sublayer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from hybrid_jax.model.mla import MLA
from tests.conftest import rel_err
from tests.parallel.test_context_model import STARTS, T, tiny_config

N = 4


def test_context_parallel_mla_through_the_flash_kernel():
    cfg = tiny_config().model
    mla = MLA(cfg, rngs=nnx.Rngs(0))
    assert mla.kernel_impl != "pallas_interpret"
    graphdef, params = nnx.split(mla)
    mla.kernel_impl = "pallas_interpret"
    flash_graphdef, _ = nnx.split(mla)
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(ks[0], (2, T, cfg.hidden_size))
    ct = jax.random.normal(ks[1], (2, T, cfg.hidden_size))
    seg = np.zeros((2, T), np.int32)
    for row, starts in enumerate(STARTS):
        for s in starts:
            seg[row, s:] += 1
    seg = jnp.asarray(seg)

    def one_device(params, x):
        o = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(o * ct), o

    def context(params, x):
        def local(params, x, seg, ct):
            o = nnx.merge(flash_graphdef, params)(x, seg, context="context")
            return jax.lax.psum(jnp.sum(o * ct), "context"), o

        time = PartitionSpec(None, "context")
        mesh = Mesh(np.asarray(jax.devices()[:N]), ("context",))
        return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), time, time, time),
                             out_specs=(PartitionSpec(), time), check_vma=False)(params, x, seg, ct)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))  # noqa: E731
    (_, want), (want_params, want_x) = grad(one_device)(params, x)
    (_, got), (got_params, got_x) = grad(context)(params, x)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    assert rel_err(got_x, want_x) < 1e-5, rel_err(got_x, want_x)
    flat_want = jax.tree_util.tree_leaves_with_path(want_params)
    for (path, w), g in zip(flat_want, jax.tree.leaves(got_params), strict=True):
        assert rel_err(g, w) < 1e-5, f"{jax.tree_util.keystr(path)}: {rel_err(g, w):.2e}"
