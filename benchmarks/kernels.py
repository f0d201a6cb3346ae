"""Time the Pallas recurrent kernels (GDN, KDA, simple GLA / Mamba2 SSD) on a GPU and check them against the XLA form.

    python -m benchmarks kernels [--only NAME ...] [--repeats 20] [--xla-timing] [--variant F=V,...] [--trace DIR]
        [--law fla|model]

bf16 inputs of FLA's benchmark law, as the reference draws them (``kernels/tooling/inputs.py``, ``law="fla"``: ``k``
L2-normalised, ``g = logsigmoid(randn) / 16`` (per key channel for KDA), ``beta = sigmoid(rand)``; ``--law model``: the
gates as a model gives them), forward and forward+backward (gradients of every input), median of ``--repeats`` timed
samples after warm-up (a sample: as many back-to-back calls as take about 20 ms, ``kernels/tooling/timing.py``). Each
result is checked against the chunked XLA form in float32 on the same inputs (relative RMS,
``kernels/tooling/errors.py``'s ``TOLERANCE``: forward <= 5e-3, gradients <= 2e-2). Prints a table and writes the record
``kernels`` (``benchmarks/record.py``).
Achieved rates use the H200's dense bf16 peak (989 TFLOP/s) and HBM bandwidth (4.8 TB/s); the FLOP and
byte counts are those of our kernel decomposition (see ``work``). KDA rows also print their time over our GDN's
at the same shape. The reference (FLA) is timed by ``python -m benchmarks fla_reference`` in the same command
(``python -m benchmarks run 'kernels' 'fla_reference'``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np

from benchmarks import record
from benchmarks.shapes import SHAPES
from hybrid_jax.kernels.tooling.calls import call, fwd_bwd, reference_run
from hybrid_jax.kernels.tooling.errors import TOLERANCE, errors, over
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.stages import stage_args, stage_ms, stage_times
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.kernels.tuning import RecurrentConfig, current_arch, override, recurrent_config

PEAK_FLOPS = 989e12  # H200 dense bf16
PEAK_BYTES = 4.8e12  # H200 HBM3e


# KDA shape -> the GDN shape it is compared with (same B, T, heads and dims)
GDN_OF = {"kda_anchor": "gdn_anchor"}


def make_fns(s: Problem, impl: str, config: RecurrentConfig | None = None):
    """(forward ``x -> o``, forward+backward ``(x, (do, None)) -> ((o, None), grads)``), jitted; ``impl`` a Pallas
    one under ``config`` (at its chunk), or ``xla`` (chunk 64)."""
    return jax.jit(lambda x: call(s, x, impl, config=config)[0]), jax.jit(fwd_bwd(s, impl, config=config))


def timing_inputs(s: Problem, config: RecurrentConfig, interpret: bool = False, every: int | None = None,
                  law: str = "fla"):
    """The benchmark's inputs at ``s`` (gates of ``law``, ``kernels/tooling/inputs.py``; no initial state), the
    output's cotangent, and every stage's arguments under ``config`` (``every``: packed documents of that many
    tokens)."""
    x, do = inputs(s, law=law, initial_state=False), cotangents(s)[0]
    return x, do, stage_args(s, config, x, do, interpret=interpret, every=every)


def work(s: Problem, C: int = 64, block_v: int = 64, block_v_bwd: int | None = None) -> dict[str, float]:
    """Matmul FLOPs and HBM bytes of our kernels, kernel by kernel (bf16 tensors 2 bytes, float32 4); ``block_v``:
    the forward state pass's V tile, ``block_v_bwd`` the reverse one's (default the same).

    Per chunk and value head; q/k reads are counted per value head (grouped heads may hit in L2). KDA is counted
    as GDN (its extra sub-chunk matmuls, exact diagonal blocks and [C, K] gate reads are not included).
    """
    K, V, d = s.K, s.V, s.delta
    NV, NV_bwd = max(1, V // block_v), max(1, V // (block_v_bwd or block_v))
    cc, ckv = 2 * C * C, 2 * C * K * V  # a [C,C] product per unit of contraction; a chunk x state product
    inv = 2 * 2 * C**3 * (np.log2(C) - 1)  # block-doubling inverse, float32
    flops_f = (cc * (2 * K + V) + inv if d else 0) + ckv * (2 if d else 1) + cc * (K + V) + ckv
    flops_b = cc * (K + V) + ckv * (3 if d else 2)  # reverse state pass
    flops_b += 2 * ckv + cc * (3 * K + V) + (cc * (3 * K + 2 * V) + ckv if d else 0)  # gradient pass
    snap = 2 * K * V  # one bf16 state snapshot
    bytes_f = (2 * K + 2 * V + 6 + 2 * V + 2 * K + 4 * C) * C if d else 0  # wy
    bytes_f += NV * (2 * K + 4 + (2 * K if d else 0)) * C + (2 * V + (2 * V if d else 0)) * C + snap  # state
    bytes_f += (4 * K + 2 * V + 4 + 2 * V) * C + snap  # output
    bytes_b = (NV_bwd * (4 * K + 4 + (2 * K if d else 0)) + 2 * V + 4 * V) * C + snap  # reverse state pass
    bytes_b += (4 * K + 4 + 4 * V + 8 * K + 4) * C + 2 * snap  # gradient pass
    bytes_b += (2 * V + 2 + 2 * V + 4 * C + 4 * V + 4 * V + 4) * C if d else 0  # v, beta, v_new, T, dvn, dv, dbeta
    n = s.B * (s.T // C) * s.HV  # chunk-heads
    return dict(
        fwd_flops=n * flops_f,
        fwdbwd_flops=n * (flops_f + flops_b),
        fwd_bytes=n * bytes_f,
        fwdbwd_bytes=n * (bytes_f + bytes_b),
    )


def time_and_check(fns, x: dict, do: jax.Array, ref, repeats: int) -> dict:
    """fwd and fwd+bwd ms of one form of the kernels (``fns``: :func:`make_fns`), and its errors against the
    reference ``ref`` (``calls.reference_run``): the output's (``err_o``), each gradient's (``err_dNAME``), their
    largest (``max_err``), and ``ok`` (within ``errors.TOLERANCE``)."""
    fwd, fb = fns
    out, grads = fb(x, (do, None))
    errs = errors(out, grads, *ref)
    res = dict(fwd_ms=median_ms(fwd, x, repeats=repeats), fwdbwd_ms=median_ms(fb, x, (do, None), repeats=repeats),
               **{f"err_{n}": e for n, e in errs.items()})
    res["max_err"] = max(errs.values())
    res["ok"] = not over(errs, TOLERANCE[str(x["v"].dtype)])
    return res


def trace_fwd_bwd(fwd_bwd, x, ct, directory: Path, calls: int = 3) -> dict:
    """Where the device time of ``calls`` calls of ``fwd_bwd(x, ct)`` (jitted) goes: a ``jax.profiler`` trace in
    ``directory`` with the HLO text beside it, summarized per kernel / XLA op (``benchmarks/trace_summary.py``) and
    printed (the summary's ``steps`` are the calls)."""
    from benchmarks.trace_summary import HLO_FILE, format_summary, summarize

    directory.mkdir(parents=True, exist_ok=True)
    (directory / HLO_FILE).write_text(fwd_bwd.lower(x, ct).compile().as_text())
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        for _ in range(calls):
            out = fwd_bwd(x, ct)
        jax.block_until_ready(out)
    summary = summarize(directory, hlo=directory / HLO_FILE, steps=calls)
    print(format_summary(summary), flush=True)
    return summary


def variant_line(shape: str, variant: str, v: dict) -> str:
    """One variant's result as a log line (``v``: :func:`time_and_check`'s dict with ``stages_ms``, or ``error``)."""
    return f"{shape} {variant}: " + (f"FAILED {v['error'][:300]}" if "error" in v else (
        f"fwd {v['fwd_ms']:.3f} ms, fwd+bwd {v['fwdbwd_ms']:.3f} ms, err o {v['err_o']:.1e}, max err "
        f"{v['max_err']:.1e}; " + "  ".join(f"{n} {ms:.3f}" for n, ms in v["stages_ms"].items())))


def run(s: Problem, repeats: int, xla_timing: bool, interpret: bool = False, other_grad: bool = False,
        variants: tuple[str, ...] = (), trace: str = "", law: str = "fla") -> dict:
    """Every figure of one problem: the table config's times, errors and stages, the variants', the XLA form's, on
    inputs of ``law``."""
    impl = "pallas_interpret" if interpret else "pallas"
    cfg = recurrent_config(per_key=s.per_key)
    x, do, args = timing_inputs(s, cfg, interpret, law=law)
    # correctness: our bf16 kernels vs the XLA form in float32 on the same inputs
    ref = reference_run(s, "xla", x, (do, None))
    fns = make_fns(s, impl, cfg)  # built once: traced below with the same compiled functions
    res = dict(dataclasses.asdict(s), delta=s.delta, per_key=s.per_key, **time_and_check(fns, x, do, ref, repeats))
    if other_grad and s.delta:  # the other gradient-pass variant (fused <-> split in two launches), same checks
        split = cfg.splits_grad(s.K, s.V)
        other = dataclasses.replace(cfg, split_grad_from=None if split else 0)
        res["other_grad"] = dict(
            split=not split,
            grad_ms=stage_ms("grad", timing_inputs(s, other, interpret, law=law)[2]["grad"], other, repeats,
                             interpret),
            **time_and_check(make_fns(s, impl, other), x, do, ref, repeats),
        )
    for variant in variants:  # the table's config with some fields changed; a failing one (e.g. shared memory
        try:  # overflow) is recorded, not fatal to the shape
            v_cfg = override(cfg, variant)
            v_fns = make_fns(s, impl, v_cfg)
            v_res = time_and_check(v_fns, x, do, ref, repeats)
            v_res["stages_ms"] = stage_times(s, v_cfg, timing_inputs(s, v_cfg, interpret, law=law)[2], repeats,
                                             interpret)
            if trace:
                print(f"{s.name} {variant}: trace", flush=True)
                v_res["trace"] = trace_fwd_bwd(v_fns[1], x, (do, None),
                                               Path(trace) / f"{s.name}_{variant.replace(',', '_')}")
        except Exception as e:  # noqa: BLE001
            v_res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res.setdefault("variants", {})[variant] = v_res
        # printed as soon as timed: a later variant that never finishes (a part's time limit) loses only itself
        print(variant_line(s.name, variant, v_res), flush=True)
    res["stages_ms"] = stage_times(s, cfg, args, repeats, interpret)
    if trace:
        res["trace"] = trace_fwd_bwd(fns[1], x, (do, None), Path(trace) / s.name)
    if xla_timing:
        xla_fwd, xla_fwd_bwd = make_fns(s, "xla")
        res["xla_fwd_ms"] = median_ms(xla_fwd, x, repeats=repeats)
        res["xla_fwdbwd_ms"] = median_ms(xla_fwd_bwd, x, (do, None), repeats=repeats)
    w = work(s, cfg.chunk, min(cfg.block_v, s.V), min(cfg.state_bwd_block_v(s.delta), s.V))
    for p in ("fwd", "fwdbwd"):
        sec = res[f"{p}_ms"] * 1e-3
        res[f"{p}_mfu"] = w[f"{p}_flops"] / sec / PEAK_FLOPS
        res[f"{p}_hbm"] = w[f"{p}_bytes"] / sec / PEAK_BYTES
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="shape names to run")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--xla-timing", action="store_true", help="also time the XLA form")
    ap.add_argument("--variant", action="append", default=[],
                    help="also time the config with FIELD=VALUE[,FIELD=VALUE] (RecurrentConfig fields, e.g. "
                         "chunk=32 or chunk=64,split_grad_from=none; repeatable)")
    ap.add_argument("--other-grad", action="store_true",
                    help="also time the other gradient-pass variant (fused or split, see tuning.split_grad_from)")
    ap.add_argument("--trace", default="", help="also trace the table config's forward+backward into DIR/SHAPE (and "
                                                "each variant's into DIR/SHAPE_VARIANT) and print where its device "
                                                "time goes (kernels and XLA ops)")
    ap.add_argument("--law", default="fla", choices=("fla", "model"),
                    help="the gates' law (kernels/tooling/inputs.py): fla (FLA's benchmark law, comparable with the "
                         "reference) or model (as a model's gates fall; KDA's diagonal blocks then take their "
                         "fallback in some chunks)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (checks the script on CPU)")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv)
    shapes = (
        [dataclasses.replace(s, B=1, T=128, H=max(1, s.H // 8), HV=max(1, s.HV // 8)) for s in SHAPES]
        if args.smoke
        else SHAPES
    )
    print(
        f"device {jax.devices()[0].device_kind}  arch {current_arch()}  jax {jax.__version__}  "
        f"config {recurrent_config()}  KDA config {recurrent_config(per_key=True)}",
        flush=True,
    )
    results, path = {}, None
    print(
        f"{'shape':<12} {'fwd ms':>8} {'f+b ms':>8} {'TF% f':>6} {'TF% fb':>6} "
        f"{'BW% f':>6} {'BW% fb':>6}  max err   ok",
        flush=True,
    )
    for s in shapes:
        if args.only and s.name not in args.only:
            continue
        try:
            r = run(s, args.repeats, args.xla_timing, interpret=args.smoke, other_grad=args.other_grad,
                    variants=tuple(args.variant), trace=args.trace, law=args.law)
        except Exception as e:  # keep going: one failing shape must not hide the others
            results[s.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{s.name:<12} FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
            continue
        if s.name in GDN_OF and "fwd_ms" in results.get(GDN_OF[s.name], {}):
            gdn = results[GDN_OF[s.name]]
            r["over_gdn_fwd"], r["over_gdn_fwdbwd"] = r["fwd_ms"] / gdn["fwd_ms"], r["fwdbwd_ms"] / gdn["fwdbwd_ms"]
            print(f"{s.name}: / our GDN  fwd {r['over_gdn_fwd']:.2f}x  fwd+bwd {r['over_gdn_fwdbwd']:.2f}x", flush=True)
        results[s.name] = r
        err = r["max_err"]
        print(
            f"{s.name:<12} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {100 * r['fwd_mfu']:6.1f} "
            f"{100 * r['fwdbwd_mfu']:6.1f} {100 * r['fwd_hbm']:6.1f} {100 * r['fwdbwd_hbm']:6.1f}  {err:.1e} "
            f"{r['ok']}" + (f"  xla {r['xla_fwd_ms']:.3f}/{r['xla_fwdbwd_ms']:.3f} ms" if args.xla_timing else ""),
            flush=True,
        )
        if "stages_ms" in r:
            print(" " * 13 + "  ".join(f"{n} {ms:.3f}" for n, ms in r["stages_ms"].items()), flush=True)
        if "other_grad" in r:
            o = r["other_grad"]
            print(f"{'':13}{'split' if o['split'] else 'fused'} gradient pass: fwd+bwd {o['fwdbwd_ms']:.3f} ms, "
                  f"grad {o['grad_ms']:.3f} ms, max err {o['max_err']:.1e}", flush=True)
        path = record.save("kernels", results, out=args.out)  # after every shape: a time limit loses only the rest
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
