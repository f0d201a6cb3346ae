"""``python -m benchmarks plan_memory`` with a context axis: the mesh is data x fsdp x context, the batch is split over
data x fsdp only, and the step (its context-parallel loss) compiles; the record is named with the context."""

import json

import jax

from benchmarks import plan_memory
from benchmarks.hlo_index import HloIndex
from benchmarks.op_families import family_bytes
from tests.conftest import REPO


def test_plan_memory_with_a_context_axis(tmp_path, capsys):
    plan_memory.main(["--config", str(REPO / "configs" / "demo.py"), "--data", "2", "--context", "4",
                      "--out", str(tmp_path)])
    assert "compiled step peak" in capsys.readouterr().out
    figures = json.loads((tmp_path / "plan_memory_demo_d2_f1_c4.json").read_text())["figures"]
    assert figures["mesh"] == {"data": 2, "fsdp": 1, "context": 4} and figures["devices"] == 8
    assert figures["global_batch_size"] == 2 * figures["micro_batch_size"]
    assert figures["compiled"]["peak_gib"] > 0
    assert figures["compiled"]["family_gb"]["MLP matmuls"] > 0 and figures["compiled"]["family_gb"]["optimizer"] > 0
    counted = figures["compiled"]["collectives"]["elsewhere"]  # context halos, the mirror swap, the latent gather
    assert counted["collective-permute"] > 0 and counted["all-gather"] > 0


def test_collectives_in_loop_bodies_are_counted_apart():
    hlo = """HloModule m

%wrapped_reduce_scatter (x: f32[4]) -> f32[2] {
  ROOT %rs.1 = f32[2]{0} reduce-scatter(%x), dimensions={0}
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  %ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %rss = ((f32[4]{0}), f32[2]{0}) async-start(%x), calls=%wrapped_reduce_scatter
}

ENTRY %main (t: (s32[], f32[4])) -> f32[4] {
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  %rs = f32[2]{0} reduce-scatter(%y), dimensions={0}
  %cp = f32[4]{0} collective-permute(%y), source_target_pairs={{0,1}}
}
"""
    assert plan_memory.collective_counts(HloIndex(hlo)) == {
        "in_loops": {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1},
        "elsewhere": {"reduce-scatter": 1, "collective-permute": 1}}


def test_family_bytes_count_loop_trips_and_tuple_elements():
    """A loop body's kernels count once per known trip, a conditional's branches once; ``%x#1`` reads the tuple's
    second array only; parameters, tuples, the loop and the conditional move nothing, nor an async pair's done;
    fused computations are not kernels of their own."""
    hlo = """HloModule m

%fused_mul (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%a, %a)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(step)/batch_loss/MLP/mul"}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %f)
}

%b0 (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%q), metadata={op_name="jit(step)/adam/neg"}
}

ENTRY %main (t: (s32[], f32[4])) -> bf16[8] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %k = f32[4]{0} conditional(%i, %x, %x), branch_computations={%b0, %b1}
  %fs = ((f32[4]{0}), f32[4]{0}) fusion-start(%k), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(step)/adam/m"}
  %fd = f32[4]{0} fusion-done(%fs)
  ROOT %c = bf16[8]{0} fusion(%w#1), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(step)/adam/convert"}
}
"""
    index = HloIndex(hlo)
    assert index.runs == {"main": 1, "body": 3, "cond": 3, "b0": 1, "b1": 1}  # each branch counted as run
    assert index.instructions["c"].bytes == 16 + 16  # bf16[8] written, f32[4] (the tuple's element 1) read
    got = {k: v for k, v in family_bytes(index).items() if v}
    assert got == {"MLP element-wise": 3 * 32, "optimizer": 32 + 32 + 48}  # an async pair by its start alone


def test_mock_gpus_and_cpu_exclude_each_other(capsys):
    import pytest

    with pytest.raises(SystemExit):
        plan_memory.main(["--config", str(REPO / "configs" / "demo.py"), "--context", "4", "--cpu", "--mock-gpus"])
    assert "--cpu, --mock-gpus and --gpu exclude each other" in capsys.readouterr().err
    if jax.devices()[0].platform != "gpu":
        saved = {key: jax.config.values[key] for key in ("jax_cuda_visible_devices", "jax_mock_gpu_topology")}
        try:
            with pytest.raises(SystemExit):
                plan_memory.main(["--config", str(REPO / "configs" / "demo.py"), "--context", "4", "--mock-gpus"])
        finally:
            for key, value in saved.items():
                jax.config.update(key, value)
        assert "--mock-gpus compiles for GPUs and this machine has none (cpu)" in capsys.readouterr().err


def test_gpu_target_descriptions(capsys):
    """``--gpu SPEC``: an unknown description is refused with the known ones; without JAX's CUDA plugin (the CPU
    suite's machines) the plan says how to install it, before compiling anything."""
    import importlib.util

    import pytest

    demo = ["--config", str(REPO / "configs" / "demo.py"), "--context", "4"]
    with pytest.raises(SystemExit):
        plan_memory.main([*demo, "--gpu", "h100"])
    assert "--gpu h100: no such target description (have h200 in" in capsys.readouterr().err
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
        with pytest.raises(SystemExit):
            plan_memory.main([*demo, "--gpu", "h200"])
        assert "--gpu needs JAX's CUDA plugin to compile for GPUs" in capsys.readouterr().err
