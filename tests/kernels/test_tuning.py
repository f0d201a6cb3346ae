"""The launch tables and their rules (``kernels/tuning.py``): the arch lookup, the config rules on head dims, the
pipeline stages capped by shared memory, and the override syntax that sweeps and variants use."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig, fit_stages, override


@pytest.mark.parametrize("kind, platform, arch", [
    ("NVIDIA H200", "gpu", "sm90"), ("NVIDIA H100 80GB HBM3", "gpu", "sm90"), ("gfx942", "rocm", "gfx942"),
    ("AMD Instinct MI300X", "rocm", "gfx942"), ("gfx950", "rocm", "gfx950"), ("AMD Instinct MI355X", "rocm", "gfx950"),
    ("NVIDIA A100-SXM4-80GB", "gpu", "fallback"), ("cpu", "cpu", "fallback"),
])
def test_tuning_lookup(kind, platform, arch):
    assert tuning.arch_of(kind, platform) == arch
    cfg = tuning.recurrent_config(arch)
    assert cfg is tuning.RECURRENT[arch] and cfg.block_v & (cfg.block_v - 1) == 0
    cfg = tuning.recurrent_config(arch, per_key=True)
    assert cfg is tuning.RECURRENT_KDA[arch] and cfg.block_v & (cfg.block_v - 1) == 0 and cfg.chunk == 16


def test_the_target_device_is_the_meshs():
    """Under a mesh (``jax.set_mesh``, or a mesh of compile-only GPUs: ``plan_memory --gpu``) the tables, ``impl=auto``
    and the context shard's groups follow the mesh's devices, not this machine's first device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh

    from hybrid_jax.kernels import registry
    from hybrid_jax.kernels.cudnn_attention import auto_impl
    from hybrid_jax.kernels.recurrent.context import group_count

    q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    assert (tuning.current_arch(), registry.resolve_impl("auto", "f"), auto_impl(q, q)) == ("fallback", "xla", "xla")
    for kind, cores, arch, attention, groups in (("NVIDIA H200", 132, "sm90", "cudnn", 2),
                                                 ("AMD Instinct MI300X", 304, "gfx942", "pallas", 4)):
        device = AbstractDevice(device_kind=kind, num_cores=cores, platform="gpu")
        with jax.sharding.use_abstract_mesh(AbstractMesh((8,), ("context",), abstract_device=device)):
            assert tuning.target_device() == (kind, "gpu", cores)
            assert (tuning.current_arch(), registry.resolve_impl("auto", "f"), auto_impl(q, q)) == (
                arch, "pallas", attention)
            assert group_count(512, 200) == groups  # within four programs per core


def test_entries_at_head_dims_come_before_the_arch_entry(monkeypatch):
    """``RECURRENT_AT_DIMS`` holds whole entries for one op at padded (K, V); a user's tuning file still comes first,
    and other ops, dims and architectures keep the architecture's entry."""
    at = tuning.recurrent_config("sm90", op="gdn", dims=(64, 64))
    assert at is tuning.RECURRENT_AT_DIMS[("sm90", "gdn", 64, 64)] and at != tuning.RECURRENT["sm90"]
    assert at.documents_branch and at.split_grad_from == tuning.RECURRENT["sm90"].split_grad_from
    assert tuning.recurrent_config("sm90", op="gdn", dims=(128, 128)) is tuning.RECURRENT["sm90"]
    assert tuning.recurrent_config("sm90", op="gla", dims=(128, 128)) is tuning.RECURRENT["sm90"]
    assert tuning.recurrent_config("gfx942", op="gdn", dims=(64, 64)) is tuning.RECURRENT["gfx942"]
    monkeypatch.setattr(tuning, "current_arch", lambda: "sm90")
    assert tuning.recurrent_config(op="gdn", dims=(64, 64)) is at
    from hybrid_jax.kernels import tuning_file

    mine = RecurrentConfig(block_v=16)
    monkeypatch.setattr(tuning_file, "active", lambda: tuning_file.TuningFile(
        path=None, device_kind="NVIDIA H200", versions={}, recurrent={("gdn", 64, 64): mine}, attention={}))
    assert tuning.recurrent_config(op="gdn", dims=(64, 64)) is mine


def test_chunks_per_program_rule():
    """The loop applies where the padded ``K * V`` reaches ``chunks_per_program_from`` (``None``: never); the sm90 KDA
    table loops at K = V = 128 only, its GDN table not at all (benchmarks/NOTES.md, option evidence)."""
    rule = RecurrentConfig(chunks_per_program=4, chunks_per_program_from=128 * 128)
    assert rule.chunks_per_program_at(128, 128) == 4
    assert rule.chunks_per_program_at(32, 64) == 1
    assert dataclasses.replace(rule, chunks_per_program_from=None).chunks_per_program_at(128, 128) == 1
    assert dataclasses.replace(rule, chunks_per_program_from=0).chunks_per_program_at(32, 64) == 4
    kda = tuning.recurrent_config("sm90", per_key=True)
    assert (kda.chunks_per_program_at(128, 128), kda.chunks_per_program_at(32, 64)) == (4, 1)
    assert tuning.recurrent_config("sm90").chunks_per_program_at(128, 128) == 1


def test_output_in_state_rule():
    """The state pass computes the output where it is on and ``K * V`` is below ``output_in_state_below`` (``None``:
    everywhere); the sm90 KDA table at its small training dims only (at K = V = 128 the model's gates make the ``wy``
    launch that also builds ``P`` slow: benchmarks/NOTES.md)."""
    rule = RecurrentConfig(output_in_state=True, output_in_state_below=128 * 128)
    assert rule.output_in_state_at(32, 64) and rule.output_in_state_at(64, 128)
    assert not rule.output_in_state_at(128, 128) and not rule.output_in_state_at(128, 256)
    assert dataclasses.replace(rule, output_in_state_below=None).output_in_state_at(128, 128)
    assert not dataclasses.replace(rule, output_in_state=False).output_in_state_at(32, 64)
    kda = tuning.recurrent_config("sm90", per_key=True)
    assert (kda.output_in_state_at(32, 64), kda.output_in_state_at(128, 128)) == (True, False)


def test_fit_stages():
    assert fit_stages(Launch(4, 3), 18_432, 227 * 1024) == Launch(4, 3)
    assert fit_stages(Launch(4, 3), 73_728, 227 * 1024) == Launch(4, 2)  # 3 x 72 KiB > 7/8 of 227 KiB
    assert fit_stages(Launch(8, 2), 10**9, 64 * 1024) == Launch(8, 1)  # at least one stage


def test_override_sets_config_and_launch_fields():
    cfg = RecurrentConfig(block_v_bwd=16, grad=Launch(8, 1))
    out = override(cfg, "chunk=32,grad.num_stages=2,block_v_bwd=none,output_in_state=true")
    assert out.chunk == 32 and out.block_v_bwd is None and out.output_in_state
    assert out.grad == Launch(8, 2) and out.wy == cfg.wy and out.state == cfg.state


@pytest.mark.parametrize("text", ["grad.warps=4", "chunks=32", "block_k=64", "chunk.num_warps=4", "chunk=big"])
def test_override_rejects_unknown_fields_and_values(text):
    with pytest.raises(ValueError, match="unknown config field|must be an integer"):
        override(RecurrentConfig(), text)
