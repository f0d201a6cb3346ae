"""The train step with ``mesh.context`` (each sequence split over 4 devices) composed with ``mesh.fsdp`` 2 and
ZeRO-1 on the 8 host devices equals the one-device step: two steps of ``tests/train/test_step.py``'s tiny MLA + GDN
model (no documents: the paths without segment ids), 4 accumulation micro-batches; and the config checks of the
axis. The one-device run is ``test_step.py``'s (cached when both run in one process)."""

import jax
import numpy as np
import pytest

from hybrid_jax.train.config_checks import ConfigError, check_config
from hybrid_jax.train.step import mesh as mesh_lib
from tests.train.common import tiny_config
from tests.train.test_step import _run


def test_context_parallel_step_equals_single_device():
    _, _, ref_state, _, ref_losses, _ = _run(1, micro=16)
    _, trainer, state, _, losses, accum = _run(8, zero1=True, micro=2, fsdp=2, context=4)
    assert dict(trainer.mesh.shape) == {"data": 1, "fsdp": 2, "context": 4} and accum == 4
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    moments = state["opt_state"][1][0]  # optax chain: (clip, adamw (mu, nu, count), ...)
    total = sum(x.nbytes for x in jax.tree.leaves((moments.mu, moments.nu)))
    held = sum(s.data.nbytes for x in jax.tree.leaves((moments.mu, moments.nu)) for s in x.addressable_shards
               if s.device == trainer.mesh.devices.flat[0])
    assert held < total / 7  # ZeRO-1 splits the moments over fsdp x context: 8 ways (a few small vectors stay whole)
    flat_ref = jax.tree_util.tree_leaves_with_path(jax.device_get(ref_state["params"]))
    for (path, want), got in zip(flat_ref, jax.tree.leaves(jax.device_get(state["params"])), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_mesh_context_axis_and_its_checks():
    config = tiny_config()
    config.mesh.context = 4
    assert mesh_lib.mesh_shape(config.mesh, 8) == (2, 1, 4)
    with pytest.raises(ValueError, match=r"context=4 does not divide the 6 devices \(with mesh.fsdp=1, mesh.context "
                                         r"can be 1, 2, 3, 6\)"):
        mesh_lib.mesh_shape(config.mesh, 6)
    assert check_config(config, 2) == 4  # batch shards: data x fsdp only
    config.mesh.context = 3
    with pytest.raises(ConfigError, match="mesh.context=3 must be a positive divisor of train.seq_len=32"):
        check_config(config, 2)
    config.mesh.context = 16  # parts of 2 tokens, GDN's conv reads 3 before each
    with pytest.raises(ConfigError, match="parts of 2 tokens, fewer than the 3"):
        check_config(config, 2)
    config.mesh.context, config.train.seq_len = 4, 36  # parts of 9 tokens: MLA trades half parts
    with pytest.raises(ConfigError, match="parts of 9 tokens, an odd number: MLA balances"):
        check_config(config, 2)
