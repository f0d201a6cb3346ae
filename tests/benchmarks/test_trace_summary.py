"""benchmarks/trace_summary.py: events of a real CPU trace are attributed to their JAX scopes through the HLO text,
and the HLO metadata parser (benchmarks/hlo_index.py) finds fusions, cuBLAS gemms and Pallas (Triton) kernels by
the names a GPU trace uses; the op families (benchmarks/op_families.py) of a GPU-style step of known shapes and
times, and of a real train step on CPU."""

import collections
import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import configs
from benchmarks.hlo_index import HloIndex, parse_op_name
from benchmarks.op_families import FAMILIES, MARKERS, MATMUL_FAMILIES, marker
from benchmarks.trace_summary import FAMILY_TOP, HLO_FILE, format_summary, main, summarize
from benchmarks.train_throughput import benchmark

# a GPU-style optimized HLO module (the long attributes filled in below): a loop fusion, a fusion whose scope is
# only on its fused op, a cuBLAS gemm and a Pallas (Triton) kernel; the stack frame table prints a frame's parent
# as its id + 1, as XLA does; the reduce's adder has a shorter stack (frame 5), as a CPU step's sort comparators
HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0})->f32[8]{0}}

FileNames
1 "/repo/benchmarks/train_throughput.py"
2 "/repo/hybrid_jax/train/loss.py"
3 "/repo/hybrid_jax/model/layers.py"
4 "/repo/kernels/api.py"

FunctionNames
1 "benchmark"
2 "cross_entropy"
3 "MLP.__call__"
4 "make_train_step.<locals>.chunk_gated_delta_rule"

FileLocations
1 {file_name_id=1 function_name_id=1 line=90 end_line=90 column=8 end_column=8}
2 {file_name_id=2 function_name_id=2 line=35 end_line=35 column=11 end_column=11}
3 {file_name_id=3 function_name_id=3 line=120 end_line=120 column=4 end_column=4}
4 {file_name_id=4 function_name_id=4 line=50 end_line=50 column=4 end_column=4}
5 {file_name_id=2 function_name_id=2 line=30 end_line=30 column=4 end_column=4}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}
4 {file_location_id=4 parent_frame_id=2}
5 {file_location_id=5 parent_frame_id=0}


%fused_convert (param_0: f32[8,16]) -> bf16[8,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  ROOT %convert.1 = bf16[8,16]{1,0} convert(%param_0), @LOSS@
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b), metadata={op_name="jit(step)/reduce_sum" stack_frame_id=5}
}

%fused_reduce (param_0.1: f32[8,16]) -> f32[8] {
  %param_0.1 = f32[8,16]{1,0} parameter(0)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.3 = f32[8]{0} reduce(%param_0.1, %constant.2), dimensions={1}, to_apply=%add, @MLP_SUM@
}

ENTRY %main.1 (p0: f32[8,16]) -> f32[8] {
  %p0 = f32[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %loop_convert_fusion.3 = bf16[8,16]{1,0} fusion(%p0), kind=kLoop, calls=%fused_convert, @LOSS@
  %input_reduce_fusion = f32[8]{0} fusion(%p0), kind=kInput, calls=%fused_reduce
  %custom-call.5 = (bf16[8,32]{1,0}, s8[0]{0}) custom-call(%loop_convert_fusion.3, %p0), @GEMM@, @MLP_DOT@
  %custom-call.6 = f32[8,16]{1,0} custom-call(%p0), @TRITON@, @PALLAS@
  ROOT %get-tuple-element.7 = f32[8]{0} get-tuple-element(%input_reduce_fusion), index=0
}
"""
FILLED_IN = {  # what the @NAME@ marks in HLO stand for
    "@LOSS@": 'metadata={op_name="jit(step)/while/body/eval_jaxpr/transpose(jvp(loss))/convert_element_type" '
              'stack_frame_id=2}',
    "@MLP_SUM@": 'metadata={op_name="jit(step)/jvp(mlp)/reduce_sum" stack_frame_id=3}',
    "@MLP_DOT@": 'metadata={op_name="jit(step)/while/body/eval_jaxpr/jvp(mlp)/dot_general" stack_frame_id=3}',
    "@PALLAS@": 'metadata={op_name="jit(step)/while/body/transpose(jvp())/pallas_call" stack_frame_id=4}',
    "@GEMM@": 'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1}}',
    "@TRITON@": 'custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"grad_bwd","num_warps":8}',
}
for mark, text in FILLED_IN.items():
    HLO = HLO.replace(mark, text)


def test_parse_op_name_drops_tracing_noise():
    assert parse_op_name("jit(step)/while/body/eval_jaxpr/transpose(jvp(HybridLM))/blocks.3/jit(silu)/mul") == (
        ["HybridLM", "blocks.3"], "bwd silu.mul")
    assert parse_op_name("jit(f)/alpha/jit(sort)/sort") == (["alpha"], "sort")
    assert parse_op_name("broadcast.92") == ([], "broadcast.92")


def test_hlo_index_finds_fusions_gemms_and_pallas_kernels():
    index = HloIndex(HLO)
    assert index.module == "jit_step"
    # a fusion by its instruction name (hlo_op) or by its kernel name; the driver's frame (benchmark) is dropped
    for name, args in (("loop_convert_fusion_3", {}), ("x", {"hlo_op": "loop_convert_fusion.3"})):
        scope = index.find(name, args)
        assert (scope.path, scope.op, scope.source) == (("cross_entropy", "loss"), "bwd convert_element_type",
                                                        "loss.py:35")
    # a cuBLAS kernel through the args that name its custom call (hlo_op, or the long name's instruction text)
    for args in ({"hlo_op": "custom-call.5", "hlo_module": "jit_step"},
                 {"long_name": "%custom-call.5 = (bf16[8,32]{1,0}, s8[0]{0}) custom-call(...)"}):
        scope = index.find("nvjet_sm90_tst_128x128_64x4_1x2_h_bz_coopA_NNT", args)
        assert (scope.path, scope.op) == (("MLP", "mlp"), "dot_general")
    # a Pallas kernel by its own name; a fusion without metadata takes its fused op's scope
    assert index.find("grad_bwd", {}).path == ("make_train_step.chunk_gated_delta_rule",)
    assert index.find("grad_bwd", {}).op == "bwd pallas_call"
    assert index.find("input_reduce_fusion", {}).path == ("MLP", "mlp")
    # another module's op of the same name is not this step's
    assert index.find("nvjet", {"hlo_op": "custom-call.5", "hlo_module": "jit_other"}) is None
    assert index.find("unknown_kernel", {"device_ordinal": "0"}) is None


def test_cpu_trace_attributes_time_to_named_scopes(tmp_path):
    def f(x, w):
        with jax.named_scope("alpha"):
            y = jnp.sort(jnp.sin(x), axis=-1)  # a sort is not fused with the matmul: one op per scope
        with jax.named_scope("beta"):
            return jnp.tanh(y @ w)

    f = jax.jit(f)
    x = w = jnp.ones((128, 128))
    (tmp_path / HLO_FILE).write_text(f.lower(x, w).compile().as_text())
    f(x, w).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            f(x, w).block_until_ready()

    s = summarize(tmp_path)
    assert s["hlo"] == str(tmp_path / HLO_FILE) and s["busy_ms"] > 0
    scopes = {r["scope"]: r["ms"] for r in s["scopes"] if r["depth"] == 1}
    assert scopes.keys() == {"alpha", "beta"} and min(scopes.values()) > 0, s["scopes"]
    assert any("alpha" in o["scope"] and "sort" in o["scope"] for o in s["ops"])
    assert any("beta" in o["scope"] and "dot_general" in o["scope"] for o in s["ops"])
    assert "hlo_op" in s["arg_keys"] and s["arg_sample"][0]["args"]["hlo_op"]
    text = format_summary(s)
    assert "by scope" in text and "alpha" in text and "beta" in text


# A GPU-style step with one or two instructions of each op family (scopes from op_name only; the frames are tested
# above): gemms, a fused dot and cuDNN attention of known shapes. (instruction, op_name below jit(step), device us
# per step, family)
GEMM = ('custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
        '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
        '"rhs_batch_dimensions":[]}}}')
FMHA = ('backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"element_type":"BF16",'
        '"dimensions":["2","4","128","128"]},"mask_type":"CAUSAL"}}')
STEP_OPS = [
    ("%mlp_gemm = (bf16[256,512]{1,0}, s8[0]{0}) custom-call(%x, %w), " + GEMM, "jvp(MLP)/Linear/dot_general", 10,
     "MLP matmuls"),
    ("%silu_fusion = bf16[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul", "jvp(MLP)/jit(silu)/mul", 3,
     "MLP element-wise"),
    ("%wrapped_concatenate = bf16[256,512]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_concat",
     "transpose(jvp(MLP))/concatenate", 2, "copies/transposes"),
    ("%transpose.1 = bf16[64,256]{0,1} transpose(%x), dimensions={1,0}", "transpose(jvp(MLP))/Linear/transpose", 1,
     "copies/transposes"),
    ("%proj_gemm = (bf16[256,128]{1,0}, s8[0]{0}) custom-call(%x, %w), " + GEMM,
     "jvp(GatedDeltaNet._mix)/Linear/dot_general", 6, "mixer projections"),
    ("%conv_fusion = bf16[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul",
     "jvp(GatedDeltaNet._mix)/RecurrentMixer.plain_conv/ShortConv._conv/mul", 4, "mixer element-wise"),
    ('%grad_bwd = f32[256,64]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", '
     'backend_config={"name":"grad_bwd"}', "transpose(jvp(GatedDeltaNet._mix))/chunk_gated_delta_rule/pallas_call",
     20, "recurrent kernels"),
    ("%fmha = (bf16[2,4,128,32]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %v), "
     'custom_call_target="__cudnn$fmhaSoftmax", ' + FMHA, "jvp(MLA)/attention/cudnn_attention/fmha", 8, "attention"),
    ("%fmha_bwd = (bf16[2,4,128,64]{3,1,2,0}, bf16[2,4,128,64]{3,1,2,0}, bf16[2,4,128,32]{3,1,2,0}, u8[0]{0}) "
     'custom-call(%q, %q, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", ' + FMHA,
     "transpose(jvp(MLA))/attention/cudnn_attention/fmha", 16, "attention"),
    ("%norm_fusion = bf16[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul",
     "jvp(HybridLM.features)/Sublayer.residual/RMSNorm.add/add_rms_norm/rms_norm/mul", 5, "norms"),
    ("%logits_fusion = f32[4,32,512]{2,1,0} fusion(%h, %e), kind=kCustom, calls=%gemm_fusion_logits",
     "cross_entropy/_chunked_ce_fwd.body/_logits/dot_general", 12, "LM head and loss"),
    ("%lse_fusion = bf16[256,512]{1,0} fusion(%x), kind=kInput, calls=%fused_mul",
     "cross_entropy/_chunked_ce_fwd.body/exp", 4, "LM head and loss"),
    ("%scatter.0 = f32[512,64]{1,0} scatter(%x, %x, %x), update_window_dims={1}",
     "transpose(jvp(HybridLM.features))/lookup/scatter-add", 3, "embedding"),
    ("%adam_fusion = bf16[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul",
     "chain.update_fn/scale_by_adam.update_fn/mul", 2, "optimizer"),
    ("%all-gather-start = (f32[8]{0}, f32[16]{0}) all-gather-start(%s), dimensions={0}", "all_gather", 3,
     "collectives"),
    ("%add.0 = bf16[256,64]{1,0} add(%x, %x)", "batch_loss/HybridLM.features/Sublayer.residual/add", 2, "other"),
]
STEP = """HloModule jit_step, is_scheduled=true

%fused_mul (p.0: bf16[256,512]) -> bf16[256,512] {
  %p.0 = bf16[256,512]{1,0} parameter(0)
  ROOT %multiply.0 = bf16[256,512]{1,0} multiply(%p.0, %p.0)
}

%fused_concat (p.1: bf16[256,256], p.2: bf16[256,256]) -> bf16[256,512] {
  %p.1 = bf16[256,256]{1,0} parameter(0)
  %p.2 = bf16[256,256]{1,0} parameter(1)
  ROOT %concatenate.0 = bf16[256,512]{1,0} concatenate(%p.1, %p.2), dimensions={1}
}

%gemm_fusion_logits (p.3: bf16[4,32,64], p.4: bf16[4,64,512]) -> f32[4,32,512] {
  %p.3 = bf16[4,32,64]{2,1,0} parameter(0)
  %p.4 = bf16[4,64,512]{2,1,0} parameter(1)
  ROOT %dot.0 = f32[4,32,512]{2,1,0} dot(%p.3, %p.4), lhs_batch_dims={0}, lhs_contracting_dims={2}, \
rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (x: bf16[256,64]) -> bf16[256,64] {
  %x = bf16[256,64]{1,0} parameter(0)
  %w = bf16[64,512]{1,0} parameter(1)
  %h = bf16[4,32,64]{2,1,0} parameter(2)
  %e = bf16[4,64,512]{2,1,0} parameter(3)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(4)
  %v = bf16[2,128,4,32]{3,2,1,0} parameter(5)
  %s = f32[8]{0} parameter(6)
""" + "".join(f'  {ins}, metadata={{op_name="jit(step)/{op_name}"}}\n' for ins, op_name, _, _ in STEP_OPS) + "}\n"
SCORES = 2 * 4 * 128 * 128  # the fused attention's B H Tq Tk


def write_step_trace(folder, steps: int) -> None:
    """The step's HLO and a device trace of ``steps`` steps: each instruction once per step on the XLA Ops line (a
    kernel name, the instruction in ``hlo_op``), then a copy that names no instruction (1 us)."""
    (folder / HLO_FILE).write_text(STEP)
    events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
              dict(ph="M", name="thread_name", pid=1, tid=2, args=dict(name="XLA Ops"))]
    ts = 0
    for _ in range(steps):
        for i, (ins, _, us, _) in enumerate(STEP_OPS):
            op = ins.split(" = ")[0].lstrip("%")
            events.append(dict(ph="X", pid=1, tid=2, ts=ts, dur=us, name=f"kernel_{i}",
                               args=dict(hlo_op=op, hlo_module="jit_step")))
            ts += us
            if op == "mlp_gemm":  # cuBLAS may clear its output first: a memset under the gemm's instruction
                events.append(dict(ph="X", pid=1, tid=2, ts=ts, dur=1, name="Memset 3", args=dict(
                    hlo_op=op, hlo_module="jit_step", Memset_details="kind:device num_bytes:4 async:1")))
                ts += 1
        events.append(dict(ph="X", pid=1, tid=2, ts=ts, dur=1, name="Memcpy DtoD", args={}))
        ts += 1
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=events), f)


def test_matmul_flops_of_gemms_fused_dots_and_cudnn_attention():
    ins = HloIndex(STEP).instructions
    assert ins["mlp_gemm"].flops == 2 * 256 * 512 * 64  # M N K, the operand's shape from its instruction
    assert ins["logits_fusion"].flops == 2 * 4 * 32 * 512 * 64  # batch dims included, the fused dot's
    assert ins["logits_fusion"].fused == {"parameter", "dot"} and ins["logits_fusion"].kind == "kCustom"
    # cuDNN: 2 S (Dqk + Dv) forward, twice that backward, both halved by the causal mask
    assert ins["fmha"].flops == 2 * SCORES * (64 + 32) / 2 and ins["fmha_bwd"].flops == 2 * ins["fmha"].flops
    assert ins["grad_bwd"].flops == 0 and ins["grad_bwd"].target == "__gpu$xla.gpu.triton"


def test_op_families_of_a_gpu_step(tmp_path, capsys):
    write_step_trace(tmp_path, steps=2)
    s = summarize(tmp_path, steps=2)
    assert [r["name"] for r in s["families"]] == list(FAMILIES)
    family = {r["name"]: r for r in s["families"]}
    expected = collections.Counter({"other": 1e-3, "MLP matmuls": 1e-3})  # the unmatched copy, the gemm's memset
    for _, _, us, name in STEP_OPS:
        expected[name] += us / 1e3
    for name in FAMILIES:  # ms per step
        assert family[name]["ms"] == pytest.approx(expected[name], abs=1e-12), name
    assert sum(r["share"] for r in s["families"]) == pytest.approx(1.0)
    assert sum(r["ms"] for r in s["families"]) == pytest.approx(s["busy_ms"] / 2)
    for name in FAMILIES:  # each family's ops: in it, biggest first, the family's time when all are listed
        top = family[name]["top_ops"]
        assert [o["ms"] for o in top] == sorted((o["ms"] for o in top), reverse=True), name
        if len(top) < FAMILY_TOP:
            assert sum(o["ms"] for o in top) == pytest.approx(family[name]["ms"], abs=1e-12), name
    assert {o["name"]: o["count"] for o in family["MLP matmuls"]["top_ops"]} == {
        f"kernel_{i}": 1.0 for i, op in enumerate(STEP_OPS) if op[3] == "MLP matmuls"} | {"Memset 3": 1.0}
    ops = {o["name"]: o["family"] for o in s["ops"]}
    assert ops == {"Memcpy DtoD": "other", "Memset 3": "MLP matmuls"} | {
        f"kernel_{i}": op[3] for i, op in enumerate(STEP_OPS)}
    # TFLOP/s of the matmul families: their matmuls' FLOPs over those events' time (us per step), once per call
    # (not again for the gemm's memset, nor over its time)
    tflops = {name: r["tflops"] for name, r in family.items()}
    assert tflops["MLP matmuls"] == pytest.approx(2 * 256 * 512 * 64 / 10e-6 / 1e12)
    assert tflops["mixer projections"] == pytest.approx(2 * 256 * 128 * 64 / 6e-6 / 1e12)
    assert tflops["LM head and loss"] == pytest.approx(2 * 4 * 32 * 512 * 64 / 12e-6 / 1e12)  # not over 16 us
    assert tflops["attention"] == pytest.approx(3 * SCORES * (64 + 32) / 24e-6 / 1e12)
    assert family["LM head and loss"]["matmul_ms"] == pytest.approx(0.012)
    # outside the matmuls: every family's time less the matmul families' matmul events (per step)
    matmuls = ("%mlp_gemm ", "%proj_gemm ", "%fmha ", "%fmha_bwd ", "%logits_fusion ")  # not the gemm's memset
    matmul_ms = sum(us / 1e3 for hlo, _, us, _ in STEP_OPS if hlo.startswith(matmuls))
    assert matmul_ms == pytest.approx(0.052)
    assert s["outside_matmuls_ms"] == pytest.approx(s["busy_ms"] / 2 - matmul_ms, abs=1e-12)
    assert all(tflops[name] is None for name in FAMILIES if name not in MATMUL_FAMILIES)
    # TB/s: the bytes of the events outside the family's matmuls (each operand whole) over their time; the
    # element-wise fusions write bf16[256,512] from bf16[256,64]; the gemm's memset moves nothing counted
    moved = (256 * 512 + 256 * 64) * 2
    assert family["MLP element-wise"]["tbps"] == pytest.approx(moved / 3e-6 / 1e12)
    assert family["MLP element-wise"]["gb"] == pytest.approx(moved / 1e9)
    assert family["LM head and loss"]["tbps"] == pytest.approx(moved / 4e-6 / 1e12)  # lse_fusion, not the dot
    assert family["MLP matmuls"]["tbps"] is None and family["MLP matmuls"]["gb"] == 0.0  # its memset alone
    assert family["mixer projections"]["tbps"] is None
    assert family["collectives"]["gb"] == pytest.approx((8 + 16 + 8) * 4 / 1e9)
    assert "by op family" in format_summary(s)
    main([str(tmp_path), "--families", "--steps", "2"])
    out = capsys.readouterr().out
    assert out.startswith("by op family") and "by scope" not in out and "1.678 TFLOP/s" in out
    assert f"outside the matmuls  {s['outside_matmuls_ms']:9.3f} ms" in out


def test_family_markers_name_the_model_code():
    """Each marker names a function or class of the model, loss, kernels or train step (a rename there must be
    made here too), and every sublayer kind has one."""
    from hybrid_jax import kernels
    from hybrid_jax.kernels import rms_norm
    from hybrid_jax.model import layers, stack
    from hybrid_jax.train.step import context_loss, loss, train_step

    named = [loss.cross_entropy, stack.tied_logits, layers.lookup, layers.RMSNorm, layers.GatedRMSNorm,
             rms_norm.rms_norm, rms_norm.add_rms_norm, kernels.chunk_gated_delta_rule, kernels.chunk_kda,
             kernels.chunk_simple_gla, kernels.attention, train_step.batch_loss, context_loss.context_batch_loss,
             stack.Sublayer, *stack.SUBLAYERS.values()]
    assert {f.__name__ for f in named} == set(MARKERS)


def test_a_rematerialised_sublayers_ops_stay_the_models():
    """Under ``model.remat`` the recomputed forward's scope starts at JAX's remat wrapper (as a CPU trace of the demo
    at remat=full reads): its residual add is the model's ("other"), not the optimizer's; its mixer ops the mixer's;
    AdamW's ops still the optimizer's."""
    remat = ("merge_inputs.merge_inputs_wrapper", "Sublayer.residual")
    assert marker(remat) == "loss" and marker((*remat, "Mamba2._mix", "GatedRMSNorm")) == "norm"
    assert marker((*remat, "Mamba2._mix")) == "mixer"
    assert marker(("step", "chain.update_fn", "scale_by_adam.update_fn")) is None  # rule 4: the optimizer


def test_op_families_of_a_real_train_step_on_cpu(tmp_path):
    """The demo config cut to one MLA and one MLP sublayer, through ``python -m benchmarks train --profile``'s path
    (about 8 s on CPU): the matmul FLOPs per traced step are the model's, the shares add up to 1."""
    config = configs.load(configs.CONFIG_DIR / "demo.py", ["model.pattern=*-", "model.num_layers=2"])
    config.train.global_batch_size = config.train.micro_batch_size
    result = benchmark(config, steps=1, warmup=1, profile=str(tmp_path), profile_steps=2, devices=jax.devices()[:1])
    profile = result["profile"]
    assert result["xla_options"] == {}  # the record says which compile options the step had: none on CPU
    family = {r["name"]: r for r in profile["families"]}
    m, mla = config.model, config.model.mla
    D, H, T = m.hidden_size, mla.num_heads, config.train.seq_len
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    train = 3 * 2 * config.train.global_batch_size * T  # FLOPs per weight and token, forward and backward
    assert family["MLP matmuls"]["flops"] == train * 3 * D * m.ffn_size
    assert family["mixer projections"]["flops"] == train * (
        D * mla.q_lora_rank + mla.q_lora_rank * H * qk + D * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        + mla.kv_lora_rank * H * (mla.qk_nope_head_dim + mla.v_head_dim) + H * mla.v_head_dim * D)
    assert family["attention"]["flops"] == train * H * T * (qk + mla.v_head_dim)  # XLA: all T x T scores
    assert family["LM head and loss"]["flops"] == pytest.approx(train * m.vocab_size * D, rel=1e-3)
    assert sum(r["share"] for r in profile["families"]) == pytest.approx(1.0)
    assert sum(r["ms"] for r in profile["families"]) == pytest.approx(profile["busy_ms"] / 2)
    present = ("LM head and loss", "embedding", "MLP matmuls", "mixer projections", "attention", "norms", "optimizer")
    assert all(family[name]["ms"] > 0 for name in present), family
    assert family["recurrent kernels"]["ms"] == family["collectives"]["ms"] == 0
    for name in MATMUL_FAMILIES:
        assert family[name]["tflops"] == pytest.approx(family[name]["flops"] / family[name]["matmul_ms"] / 1e9)
    assert "by op family" in (tmp_path / "trace_summary.txt").read_text()
