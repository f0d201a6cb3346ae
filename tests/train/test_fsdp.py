"""ZeRO-3 (``mesh.fsdp``) on 8 CPU devices: each device holds 1/N of the weights and moments, the planner's
arithmetic (``benchmarks/plan_memory.py``) is what the arrays hold, and a checkpoint written on an fsdp 4 x data 2
mesh restores bit-identically onto 2 data-parallel devices and continues with the same loss; an out-of-memory
becomes one line naming the knobs still to turn.

The fsdp 4 x data 2 losses against one device are a case of ``test_step.py``'s
``test_data_parallel_step_equals_single_device``; these tests reuse its cached run (one compile).
"""

import jax
import numpy as np
import pytest

from benchmarks.plan_memory import full_bytes, shard_bytes
from hybrid_jax.checkpoints import Checkpointer
from hybrid_jax.train.stops import out_of_memory_message
from hybrid_jax.train.trainer import build_trainer
from tests.train.common import tiny_config
from tests.train.test_step import _batches, _run, _setup

FSDP = 4  # x data 2 on the 8 devices


def _bytes_on(tree, device) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def _like(state):
    """The restore target: ``ShapeDtypeStruct`` leaves with ``state``'s shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_each_device_holds_one_nth_of_weights_and_moments():
    config, trainer, state, *_ = _run(8, zero1=True, fsdp=FSDP)
    mesh = trainer.mesh
    assert dict(mesh.shape) == {"data": 2, "fsdp": FSDP, "context": 1}
    params, moments = state["params"], state["opt_state"][1][0]  # optax chain: (clip, adamw (mu, nu, count), ...)
    moments = dict(mu=moments.mu, nu=moments.nu)
    total_params, total_moments = full_bytes(params), full_bytes(moments)
    assert total_params > 100_000 and total_moments == 2 * total_params
    for device in mesh.devices.flat:
        assert _bytes_on(params, device) == total_params // FSDP  # every leaf split over fsdp, copies over data
        # ZeRO-1 on top: moments over all 8; only the (4,)-shaped A_log / dt_bias moments stay whole
        assert _bytes_on(moments, device) == pytest.approx(total_moments / 8, rel=0.01)
        assert _bytes_on(moments, device) < total_moments / 7
    # the planner's bytes per device, from abstract state on the same mesh, are what the arrays hold
    abstract = build_trainer(config, list(mesh.devices.flat), abstract=True).abstract_state
    device = mesh.devices.flat[0]
    assert shard_bytes(abstract["params"]) == _bytes_on(params, device)
    assert shard_bytes(abstract["opt_state"]) == _bytes_on(state["opt_state"], device)
    assert full_bytes(abstract) == full_bytes(state)


def test_checkpoint_of_an_fsdp_mesh_restores_on_two_data_devices(tmp_path):
    config, trainer8, state8, step8, losses, _ = _run(8, zero1=True, fsdp=FSDP)
    assert int(state8["step"]) == 2
    saved = jax.device_get(state8)
    ckpt = Checkpointer(tmp_path, config)
    assert ckpt.save(2, state8, dict(sequences=32), force=True)
    ckpt.wait()
    next_batch = _batches(config, 3)[2]

    # the same run continued on its own mesh, from the checkpoint (the cached state8 is not donated)
    restored8, position = ckpt.restore(_like(state8), 2)
    assert position == dict(sequences=32)
    _, metrics8 = step8(restored8, trainer8.put(next_batch))

    # restored onto 2 devices, data parallel only, moments replicated (no ZeRO-1): a fresh state gives the target
    _, trainer2, fresh2, step2, accum2 = _setup(2, micro=8)
    assert dict(trainer2.mesh.shape) == {"data": 2, "fsdp": 1, "context": 1} and accum2 == 1
    restored2, _ = ckpt.restore(_like(fresh2), 2)
    ckpt.close()
    for (path, want), got, target in zip(jax.tree_util.tree_leaves_with_path(saved), jax.tree.leaves(restored2),
                                         jax.tree.leaves(fresh2), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
        assert got.sharding == target.sharding and len(got.sharding.device_set) == 2
    _, metrics2 = step2(restored2, trainer2.put(next_batch))

    loss8, loss2 = float(metrics8["loss"]), float(metrics2["loss"])
    assert np.isfinite(loss2) and bool(metrics2["finite"])
    np.testing.assert_allclose(loss2, loss8, rtol=1e-6)
    np.testing.assert_allclose(float(metrics2["grad_norm"]), float(metrics8["grad_norm"]), rtol=1e-5)
    assert abs(loss2 - losses[-1]) > 1e-4  # a third step of the trained state, not a replay of a saved loss


def test_out_of_memory_is_one_line_naming_the_knobs_still_to_turn():
    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25.12GiB.\nBufferAssignment ...")
    config = tiny_config(micro_batch_size=4, zero1=False)
    line = out_of_memory_message(xla, config, 4)
    assert "\n" not in line and "allocate 25.12GiB" in line and "mesh data 4 x fsdp 1" in line
    knobs = ["train.micro_batch_size (now 4", "model.remat=full (now none)", "mesh.fsdp=2 or more", "train.zero1=true"]
    assert [line.index(k) for k in knobs] == sorted(line.index(k) for k in knobs)  # in the order to try them
    # the knobs already turned are not offered again; one GPU at full fsdp: more GPUs
    config = tiny_config(micro_batch_size=1, zero1=True)
    config.model.remat, config.mesh.fsdp = "full", 1
    line = out_of_memory_message(xla, config, 1)
    assert "micro_batch_size" not in line and "remat=full" not in line and "zero1=true" not in line
    assert "more GPUs, with mesh.fsdp over all of them (now 1 of 1)" in line
    assert out_of_memory_message(ValueError("shapes do not match"), config, 1) is None
