"""Are the small ops (norms, SwiGLU, short conv, chunked cross-entropy) already at the roofline under XLA?

    python -m benchmarks small_ops [--config configs/zebra_300m_gdn.py] [--batch 8] [--repeats 20] [--out DIR]
    python -m benchmarks small_ops --smoke      # the demo config (bf16) at batch 1 x 64 on CPU: checks the script only

Times the project's own modules, jitted, at one training micro-batch (``batch x seq_len`` tokens of the config;
8 x 2048 at the 300M recipe) in the config's compute dtype (bf16): the forward, and the forward+backward
(``jax.vjp``: the output and the gradients of every input and parameter for a random cotangent). After 2 warm-up
calls, the median over ``--repeats`` samples of the time per call, a sample being back-to-back calls (enough to
last >= 1 ms at the roofline, at most 100: one launch latency, ~10 us, is as long as a whole small op here) that
rotate through copies of the inputs (>= 256 MB in all, at most 8 copies, so the 50 MB L2 does not serve a call
its predecessor's inputs). An op whose host dispatch takes > 80% of its time is flagged ``host_bound``: its GPU
time is lower than measured. The ops:

* ``rmsnorm``: the sublayer pre-norm ``RMSNorm(hidden)`` on ``[B, T, D]``; ``add_rmsnorm``: the residual stream's add
  with it (``RMSNorm.add(x, y)``, both ``[B, T, D]``: the stream and its norm), also as ``add_rmsnorm_xla``.
* ``gdn_gated_norm``: GDN's ``out_norm(o, z)`` (``rmsnorm(o) * w * silu(z)``) on ``o, z: [B, T, Hv, dv]``.
* ``mamba2_gated_norm``: Mamba2's ``norm(y, z)`` (gate first, per group) on ``y, z: [B, T, expand * D]``.
* ``silu_mul``: ``silu(gate) * up`` on ``[B, T, F]``, the element-wise part of the SwiGLU MLP.
* ``mlp``: the whole ``MLP`` block on ``[B, T, D]`` (two matmuls around ``silu_mul``).
* ``short_conv``: GDN's depthwise causal conv (kernel ``conv_size``) + SiLU on its q/k/v channels ``[B, T, C]``;
  ``mamba2_conv``: Mamba2's (with a bias) on its ``x, B, C`` channels; each also as ``*_xla``, its backward in XLA
  instead of the Pallas kernel.
* ``cross_entropy``: ``hybrid_jax.train.loss.cross_entropy`` (token chunks of ``train.loss_chunk_size``) of
  the features ``[B*T, D]`` against the tied embedding ``[V, D]`` as the trainer passes it (float32 master
  weights) and int32 labels (not differentiated); the loss is a scalar, so its cotangent is one random number.

Rooflines on the H200 (4.8 TB/s HBM, 989 TFLOP/s dense bf16). Memory: ``min bytes`` = every argument read once
plus every result written once (forward: inputs, parameters, output; forward+backward: also the cotangent and the
gradients), so ``% HBM = min bytes / time / 4.8 TB/s``; no kernel, Pallas included, moves fewer bytes. Matmul
(``mlp``, ``cross_entropy``): model FLOPs ``6 N D F`` (MLP) and ``2 N V D`` (CE) forward, 3x for forward+backward
(the CE takes its three matmuls in one pass when differentiated), against the bf16 peak.
The verdict uses the op's own bound (HBM, or the matmul peak where it has matmuls): at >= 70% of it, forward
and forward+backward, XLA leaves no room for a hand-written kernel; well below it the op is a fusion candidate.
The ``silu_mul`` share of the ``mlp`` time is printed too. Prints a table and saves the record ``small_ops``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from benchmarks import record
from hybrid_jax.config import load_config_file
from hybrid_jax.kernels.tooling.timing import back_to_back_ms
from hybrid_jax.model.gdn import GatedDeltaNet
from hybrid_jax.model.layers import MLP, RMSNorm, ShortConv
from hybrid_jax.model.mamba2 import Mamba2
from hybrid_jax.train.step.loss import cross_entropy

PEAK_FLOPS = 989e12  # H200 dense bf16
PEAK_BYTES = 4.8e12  # H200 HBM3e
AT_ROOFLINE = 0.7  # fraction of the bound above which a hand-written kernel has no room
SAMPLE_S = 1e-3  # a timed sample lasts at least this long at the roofline (launch latency amortised) ...
MAX_INNER = 100  # ... in at most this many back-to-back calls
ROTATE_BYTES = 256e6  # consecutive calls rotate through input copies of this many bytes in all (> 50 MB L2) ...
MAX_COPIES = 8  # ... at most this many copies
HOST_BOUND = 0.8  # issuing a call takes this fraction of its time: the host, not the GPU, sets the pace
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclasses.dataclass(frozen=True)
class Op:
    """``fn(*diff, *const) -> output``: differentiated arguments (parameters first) and constant ones (labels)."""

    name: str
    shape: str
    fn: Callable[..., jax.Array]
    diff: tuple
    const: tuple = ()
    flops: float = 0.0  # forward model FLOPs (matmuls); 0 for a memory-bound op


def module_op(name: str, shape: str, module: nnx.Module, call: Callable, inputs: tuple, flops: float = 0.0) -> Op:
    """An op of a module's parameters and ``inputs``: ``call(module, *inputs)``."""
    graphdef, params = nnx.split(module)
    return Op(name, shape, lambda p, *x: call(nnx.merge(graphdef, p), *x), (params, *inputs), flops=flops)


def make_ops(cfg: ConfigDict, batch: int, seq: int, ce_chunks: tuple[int, ...] = ()) -> list[Op]:
    """The ops at ``batch x seq`` tokens of the config ``cfg`` (model and train sections), random bf16 inputs;
    the cross-entropy at ``train.loss_chunk_size`` and at each of ``ce_chunks``."""
    m = cfg.model
    dtype = jnp.dtype(m.dtype)
    rngs = nnx.Rngs(0)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 16))
    rand = lambda *shape: jax.random.normal(next(keys), shape, dtype)  # noqa: E731
    B, T, D, F, V = batch, seq, m.hidden_size, m.ffn_size, m.vocab_size
    N = B * T
    gdn = GatedDeltaNet(m, rngs=rngs)
    hv, dv, C = gdn.hv, gdn.dv, gdn.conv1d.kernel.shape[1]
    mamba2 = Mamba2(m, rngs=rngs)
    d_in = mamba2.d_in
    embedding = jax.random.normal(next(keys), (V, D), jnp.dtype(m.param_dtype)) * m.init_std
    labels = jax.random.randint(next(keys), (N,), 0, V, jnp.int32)
    ce = [
        Op(
            "cross_entropy",
            f"[{N},{D}] V={V} chunk={chunk}",
            functools.partial(lambda h, e, t, c: cross_entropy(h, e, t, chunk_size=c), c=chunk),
            (rand(N, D), embedding),
            (labels,),
            flops=2.0 * N * V * D,
        )
        for chunk in (cfg.train.loss_chunk_size, *ce_chunks)
    ]
    return [
        module_op(
            "rmsnorm", f"[{B},{T},{D}]", RMSNorm(D, eps=m.norm_eps, dtype=dtype), lambda n, x: n(x), (rand(B, T, D),)
        ),
        *kernel_and_xla("add_rmsnorm", f"[{B},{T},{D}] x2", RMSNorm(D, eps=m.norm_eps, dtype=dtype),
                        lambda n, x, y: n.add(x, y), (rand(B, T, D), rand(B, T, D))),
        module_op(
            "gdn_gated_norm",
            f"[{B},{T},{hv},{dv}] x2",
            gdn.out_norm,
            lambda n, o, z: n(o, z),
            (rand(B, T, hv, dv), rand(B, T, hv, dv)),
        ),
        module_op(
            "mamba2_gated_norm",
            f"[{B},{T},{d_in}] x2 G={mamba2.groups}",
            mamba2.norm,
            lambda n, y, z: n(y, z),
            (rand(B, T, d_in), rand(B, T, d_in)),
        ),
        Op("silu_mul", f"[{B},{T},{F}] x2", lambda a, b: jax.nn.silu(a) * b, (rand(B, T, F), rand(B, T, F))),
        module_op(
            "mlp", f"[{B},{T},{D}] F={F}", MLP(m, rngs=rngs), lambda n, x: n(x), (rand(B, T, D),), flops=6.0 * N * D * F
        ),
        *conv_ops("short_conv", gdn.conv1d, rand(B, T, C)),
        *conv_ops("mamba2_conv", mamba2.conv1d, rand(B, T, mamba2.conv1d.kernel.shape[1])),
        *ce,
    ]


def conv_ops(name: str, conv: ShortConv, x: jax.Array) -> list[Op]:
    """A short conv on ``x [B, T, C]`` as :func:`kernel_and_xla` runs it."""
    return kernel_and_xla(name, f"[{','.join(map(str, x.shape))}] k={conv.kernel.shape[0]}", conv, lambda m, x: m(x),
                          (x,))


def kernel_and_xla(name: str, shape: str, module: nnx.Module, call: Callable, inputs: tuple) -> list[Op]:
    """A module with its own kernels twice: ``name`` as the model runs it (Pallas on a GPU) and ``name_xla`` with
    ``kernel_impl="xla"``, for their ratio in one command."""
    xla = nnx.clone(module)
    xla.kernel_impl = "xla"
    return [module_op(n, shape, m, call, inputs) for n, m in ((name, module), (f"{name}_xla", xla))]


def functions(op: Op) -> tuple[Callable, Callable]:
    """Jitted ``fwd(*leaves) -> y`` and ``fwd_bwd(dy, *leaves) -> [y, *gradient leaves of diff]``.

    ``leaves`` are those of ``(op.diff, op.const)``: flat array arguments and results keep the dispatch fast.
    """
    treedef = jax.tree.structure((op.diff, op.const))

    def fwd(*leaves):
        diff, const = jax.tree.unflatten(treedef, leaves)
        return op.fn(*diff, *const)

    def fwd_bwd(dy, *leaves):
        diff, const = jax.tree.unflatten(treedef, leaves)
        y, vjp = jax.vjp(lambda *d: op.fn(*d, *const), *diff)
        return [y, *jax.tree.leaves(vjp(dy))]

    return jax.jit(fwd), jax.jit(fwd_bwd)


def nbytes(*trees) -> int:
    """Total bytes of the arrays (or shape structs) in ``trees``."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(trees))


def measure(op: Op, repeats: int) -> dict:
    """Times, minimum bytes and achieved fractions of the HBM and matmul peaks of one op."""
    fwd, fwd_bwd = functions(op)
    leaves = jax.tree.leaves((op.diff, op.const))
    y = jax.eval_shape(fwd, *leaves)
    dy = jax.tree.map(lambda s: jax.random.normal(jax.random.PRNGKey(2), s.shape, s.dtype), y)
    res = dict(
        op=op.name,
        shape=op.shape,
        fwd_bytes=nbytes(leaves, y),
        fwdbwd_bytes=nbytes(leaves, dy, jax.eval_shape(fwd_bwd, dy, *leaves)),
    )
    roofline_s = max(res["fwd_bytes"] / PEAK_BYTES, op.flops / PEAK_FLOPS)
    copies = min(MAX_COPIES, math.ceil(ROTATE_BYTES / res["fwd_bytes"]))
    inner = min(MAX_INNER, math.ceil(SAMPLE_S / roofline_s))
    sets = [leaves] + [[jnp.copy(x) for x in leaves] for _ in range(copies - 1)]
    res.update(copies=copies, calls_per_sample=inner)
    res["fwd_ms"], res["fwd_issue_ms"] = back_to_back_ms(fwd, sets, repeats, inner)
    res["fwdbwd_ms"], res["fwdbwd_issue_ms"] = back_to_back_ms(fwd_bwd, [(dy, *a) for a in sets], repeats, inner)
    res["host_bound"] = any(res[f"{p}_issue_ms"] > HOST_BOUND * res[f"{p}_ms"] for p in ("fwd", "fwdbwd"))
    for p, flops in (("fwd", op.flops), ("fwdbwd", 3 * op.flops)):
        sec = res[f"{p}_ms"] * 1e-3
        res[f"{p}_hbm"] = res[f"{p}_bytes"] / sec / PEAK_BYTES
        if op.flops:
            res[f"{p}_tflops"] = flops / sec / 1e12
            res[f"{p}_mfu"] = flops / sec / PEAK_FLOPS
        res[f"{p}_bound"] = res[f"{p}_mfu"] if op.flops else res[f"{p}_hbm"]
    res["bound"] = "matmul" if op.flops else "hbm"
    res["at_roofline"] = res["fwd_bound"] >= AT_ROOFLINE and res["fwdbwd_bound"] >= AT_ROOFLINE
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks small_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIGS / "zebra_300m_gdn.py", help="config file (shapes)")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch size (sequences)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    ap.add_argument("--ce-chunks", default="", help="comma list: also time the cross-entropy at these chunk sizes")
    ap.add_argument("--smoke", action="store_true", help="the demo config at batch 1 x 64 on CPU (checks the script)")
    ap.add_argument("--only", nargs="+", default=None, metavar="OP", help="time these ops only (names as printed)")
    args = ap.parse_args(argv)
    cfg = load_config_file(CONFIGS / "demo.py" if args.smoke else args.config)
    batch, seq, repeats = (1, 64, 2) if args.smoke else (args.batch, cfg.train.seq_len, args.repeats)
    if args.smoke:
        cfg.model.dtype = "bfloat16"  # the demo trains in float32; the ops are measured in bf16
    tokens = batch * seq
    print(
        f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  config {cfg.model.name}  "
        f"dtype {cfg.model.dtype}  micro-batch {batch} x {seq} = {tokens} tokens  median of {repeats}",
        flush=True,
    )
    print(
        f"{'op':<18} {'shape':<30} {'fwd ms':>8} {'f+b ms':>8} {'MB f':>8} {'MB f+b':>8} {'HBM% f':>6} "
        f"{'HBM%fb':>6} {'TF/s f':>6} {'TF/s fb':>7} {'MFU% f':>6} {'MFU%fb':>6} {'ns/tok fb':>9}  verdict",
        flush=True,
    )
    results = []
    ops = make_ops(cfg, batch, seq, tuple(int(c) for c in args.ce_chunks.split(",") if c))
    unknown = sorted(set(args.only or ()) - {op.name for op in ops})
    if unknown:
        raise SystemExit(f"small_ops: no op {', '.join(unknown)}; the ops: {', '.join(op.name for op in ops)}")
    for op in ops if args.only is None else [op for op in ops if op.name in args.only]:
        r = measure(op, repeats)
        r["fwdbwd_ns_per_token"] = 1e6 * r["fwdbwd_ms"] / tokens
        results.append(r)
        mm = lambda k, w: f"{r[k]:{w}.0f}" if k in r else f"{'-':>{w}}"  # noqa: E731
        pct = lambda k: f"{100 * r[k]:6.1f}" if k in r else f"{'-':>6}"  # noqa: E731
        verdict = f"{r['bound']} {'at roofline' if r['at_roofline'] else 'candidate'}"
        verdict += " (host-bound: the GPU time is lower)" if r["host_bound"] else ""
        print(
            f"{r['op']:<18} {r['shape']:<30} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {r['fwd_bytes'] / 1e6:8.1f} "
            f"{r['fwdbwd_bytes'] / 1e6:8.1f} {pct('fwd_hbm')} {pct('fwdbwd_hbm')} {mm('fwd_tflops', 6)} "
            f"{mm('fwdbwd_tflops', 7)} {pct('fwd_mfu')} {pct('fwdbwd_mfu')} {r['fwdbwd_ns_per_token']:9.2f}  "
            f"{verdict}",
            flush=True,
        )
    by_op = {r["op"]: r for r in reversed(results)}  # the first of a name (the config's CE chunk) wins
    share = {p: by_op["silu_mul"][f"{p}_ms"] / by_op["mlp"][f"{p}_ms"] for p in ("fwd", "fwdbwd")
             if {"silu_mul", "mlp"} <= by_op.keys()}
    if share:
        print(f"silu_mul share of the mlp time: fwd {100 * share['fwd']:.1f}%  fwd+bwd {100 * share['fwdbwd']:.1f}%")
    kernel_over_xla = {n: {p: by_op[n][f"{p}_ms"] / by_op[f"{n}_xla"][f"{p}_ms"] for p in ("fwd", "fwdbwd")}
                       for n in by_op if f"{n}_xla" in by_op}  # every op timed beside its XLA twin
    for n, ratio in kernel_over_xla.items():
        print(f"{n}: with its Pallas kernels over XLA's: forward {ratio['fwd']:.3f}x, forward+backward "
              f"{ratio['fwdbwd']:.3f}x")
    summary = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        config=cfg.model.name,
        dtype=cfg.model.dtype,
        batch=batch,
        seq_len=seq,
        tokens=tokens,
        repeats=repeats,
        peak_flops=PEAK_FLOPS,
        peak_bytes_per_s=PEAK_BYTES,
        at_roofline_threshold=AT_ROOFLINE,
        silu_mul_share_of_mlp=share,
        kernel_over_xla=kernel_over_xla,
        ops=results,
    )
    record.save("small_ops", summary, out=args.out)


if __name__ == "__main__":
    main()
