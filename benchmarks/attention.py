"""Causal attention on one GPU: our Pallas flash kernel vs cuDNN (``jax.nn.dot_product_attention``) vs ``auto``.

Forward and forward+backward, bf16, B8 T2048, at H16 D128 and the MLA shapes of the 300M (H16, Dqk 64, Dv 64),
1B (H32, 64/64) and 3B (H24, 128/128) configs (``benchmarks/shapes.py``). First checks the GPU results (values and the
three gradients, also at ragged T and Dqk != Dv) against the float32 XLA reference. ``--sweep`` first searches the
block configs per kernel (``kernels/tooling/sweep.py``: coordinate descent at the first shape of each head dim, each
winner checked against the float32 reference) and times the best beside the table's. Prints a table and saves the
record ``attention`` (rewritten after each shape, so a time limit keeps the shapes done). ``--smoke`` runs tiny
shapes (interpreted on CPU). The reference, PyTorch SDPA at the same shapes, is ``python -m benchmarks fla_reference
--attention-only`` (its own process: ``run`` puts both in one command).

    python -m benchmarks attention [--sweep] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from benchmarks import record
from benchmarks.shapes import ATTENTION_SHAPES
from hybrid_jax.kernels import cudnn_attention as cudnn
from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.tooling.calls import call, errors_against, fwd_bwd
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem, pow2
from hybrid_jax.kernels.tooling.sweep import AttentionSearch, sweep
from hybrid_jax.kernels.tooling.timing import median_ms

CHECKS = [  # (problem, causal)
    (Problem("attention", 2, 1000, 4, 4, 48, 32), True),
    (Problem("attention", 2, 1000, 4, 4, 48, 32), False),
    (Problem("attention", 2, 2048, 4, 4, 64, 64), True),
    (Problem("attention", 2, 2048, 4, 4, 128, 128), True),
    (Problem("attention", 1, 300, 2, 2, 64, 64, "float32"), True),
]


def vjp_of(attend):
    """``(x, (do, _)) -> ((o, None), {q, k, v gradients})`` of ``attend(x) -> o``, as ``calls.fwd_bwd`` gives it for
    our kernels (for cuDNN, which is no impl of ours)."""
    def run(x, ct):
        o, vjp = jax.vjp(attend, x)
        return (o, None), vjp(ct[0].astype(o.dtype))[0]

    return run


def check(interpret: bool, gpu: bool, checks: list[tuple[Problem, bool]]) -> list[dict]:
    """Relative RMS errors of ours (and cuDNN) vs the float32 XLA reference, forward and dq, dk, dv."""
    rows = []
    for p, causal in checks:
        x, ct = inputs(p), cotangents(p)
        impls = {"pallas": None}
        if gpu and cudnn.cudnn_head_dim(x["q"], x["v"]) is not None:
            impls["cudnn"] = jax.jit(vjp_of(lambda x, c=causal: cudnn.cudnn_attention(x["q"], x["k"], x["v"],
                                                                                       causal=c)))
        label = f"B{p.B} T{p.T} H{p.H} qk{p.K} v{p.V} {p.dtype:8s} causal={causal}"
        for name, fn in impls.items():
            try:
                errs = errors_against(p, "pallas_interpret" if interpret else "pallas", "xla", x, ct, fn=fn,
                                      causal=causal)
            except Exception as e:  # recorded, so that one failing case does not hide the rest
                print(f"check {name} {label}: failed {str(e)[:300]}")
                rows.append(dict(impl=name, shape=[p.B, p.T, p.H, p.K, p.V], dtype=p.dtype, error=str(e)))
                continue
            rows.append(dict(impl=name, shape=[p.B, p.T, p.H, p.K, p.V], dtype=p.dtype, causal=causal,
                             fwd=errs["o"], dq=errs["dq"], dk=errs["dk"], dv=errs["dv"]))
            print(f"check {name:6s} {label}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items()), flush=True)
    return rows


def search(p: Problem, interpret: bool, budget_s: float) -> tuple[tuning.AttentionConfig, list[dict]]:
    """The best tiles at ``p`` from the table's (coordinate descent, ``kernels/tooling/sweep.py``) and every
    candidate tried."""
    s = AttentionSearch([p], tuning.attention_config(None, pow2(max(p.K, p.V))), interpret=interpret,
                        repeats=5)
    best = sweep(s, time.perf_counter() + budget_s, note=lambda text: print(f"sweep D{max(p.K, p.V)} {text}"))
    for t in s.tried:
        print(f"sweep D{max(p.K, p.V)} {t['field']} {t['value']}: {t['ms']:.3f} ms {t['outcome']}", flush=True)
    return best, s.tried


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks attention", description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="search the tiles and time the best beside the table")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (interpreted when no GPU)")
    parser.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    interpret = not gpu
    shapes = [dataclasses.replace(p, B=1, T=128, H=2, HV=2) for p in ATTENTION_SHAPES] if args.smoke \
        else ATTENTION_SHAPES
    checks = [(Problem("attention", 1, 100, 2, 2, 48, 32), True)] if args.smoke else CHECKS
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, jax=jax.__version__, arch=tuning.current_arch(),
                  checks=check(interpret, gpu, checks))

    def dump():
        record.save("attention", result, out=args.out)

    dump()
    configs = {}  # head dim class -> {label: AttentionConfig}
    for p in shapes:
        d = pow2(max(p.K, p.V))
        configs.setdefault(d, {"table": tuning.attention_config(None, d)})
        if args.sweep and "best" not in configs[d]:
            configs[d]["best"], result[f"sweep_D{d}"] = search(p, interpret, budget_s=50)
            result[f"best_D{d}"] = repr(configs[d]["best"])
            dump()
    print(f"\n{dev.device_kind}, jax {jax.__version__}, causal bf16; ms per call (fwd / fwd+bwd)", flush=True)
    timings = result["timings"] = {}
    impl = "pallas_interpret" if interpret else "pallas"
    for p in shapes:
        x, ct = inputs(p), cotangents(p)
        impls = {f"pallas_{label}": (impl, cfg) for label, cfg in configs[pow2(max(p.K, p.V))].items()}
        if gpu:
            impls["cudnn"] = ("cudnn", None)
            impls["auto"] = ("auto", None)
        row = timings[p.name] = {"auto_choice": cudnn.auto_impl(x["q"], x["v"])}
        for label, (name, cfg) in impls.items():
            if name == "cudnn":
                attend = lambda x: jax.nn.dot_product_attention(x["q"], x["k"], x["v"], is_causal=True,  # noqa: E731
                                                                implementation="cudnn")
                fwd, fb = jax.jit(attend), jax.jit(vjp_of(attend))
            else:
                fwd = jax.jit(lambda x, name=name, cfg=cfg: call(p, x, name, config=cfg)[0])
                fb = jax.jit(fwd_bwd(p, name, config=cfg))
            try:
                row[label] = (median_ms(fwd, x, repeats=10), median_ms(fb, x, ct, repeats=10))
            except Exception as e:  # noqa: BLE001
                print(f"{p.name} {label}: failed {str(e)[:200]}", flush=True)
                continue
            print(f"{p.name:24s} {label:14s} {row[label][0]:7.3f} / {row[label][1]:7.3f}", flush=True)
        if "cudnn" in row:
            for label in [x for x in impls if x.startswith("pallas") and x in row]:
                row[f"{label}_over_cudnn"] = tuple(a / b for a, b in zip(row[label], row["cudnn"], strict=True))
                print(f"{p.name:24s} {label} / cudnn: {row[f'{label}_over_cudnn'][0]:.2f}x / "
                      f"{row[f'{label}_over_cudnn'][1]:.2f}x", flush=True)
        dump()


if __name__ == "__main__":
    main()
