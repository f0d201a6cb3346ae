"""Causal attention on one GPU: our Pallas flash kernel vs cuDNN (``jax.nn.dot_product_attention``) vs ``auto``.

Forward and forward+backward, bf16, B8 T2048, at H16 D128 and the MLA shapes of the 300M (H16, Dqk 64, Dv 64),
1B (H32, 64/64) and 3B (H24, 128/128) configs. First checks the GPU results (values and the three gradients,
also at ragged T and Dqk != Dv) against the float32 XLA reference. ``--sweep`` first tries a few block configs
per kernel (coordinate descent at H16, per head dim) and times the best beside the table's. Prints a table and
saves the record ``attention`` (rewritten after each shape, so a time limit keeps the shapes done). ``--smoke``
runs tiny shapes (interpreted on CPU). The reference, PyTorch SDPA at the same shapes, is
``python -m benchmarks fla_reference --attention-only`` (its own process: ``run`` puts both in one command).

    python -m benchmarks attention [--sweep] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import record
from benchmarks.shapes import ATTENTION_SHAPES as SHAPES
from hybrid_jax import kernels
from hybrid_jax.kernels import cudnn_attention as cudnn
from hybrid_jax.kernels import flash_attention as flash
from hybrid_jax.kernels import reference, tuning
from hybrid_jax.kernels.registry import OPS

CHECKS = [  # (B, T, H, Dqk, Dv, dtype, causal)
    (2, 1000, 4, 48, 32, jnp.bfloat16, True),
    (2, 1000, 4, 48, 32, jnp.bfloat16, False),
    (2, 2048, 4, 64, 64, jnp.bfloat16, True),
    (2, 2048, 4, 128, 128, jnp.bfloat16, True),
    (1, 300, 2, 64, 64, jnp.float32, True),
]
CANDIDATES = OPS["attention"].search_space()  # kernel -> tiles to try (kernels/registry.py)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(B, T, H, dqk, dv, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, T, H, dqk), (B, T, H, dqk), (B, T, H, dv), (B, T, H, dv)]
    return [jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(ks, shapes, strict=True)]


def fwd_and_grad(attn):
    """Jitted forward, and jitted forward+backward (grads of ``sum(o * do)``, as the anchors time it)."""
    fwd = jax.jit(attn)
    grad = jax.jit(jax.grad(lambda q, k, v, do: (attn(q, k, v).astype(jnp.float32) * do).sum(), argnums=(0, 1, 2)))
    return fwd, grad


def bench(f, *args, n: int = 20, reps: int = 3) -> float:
    """Milliseconds per call: best of ``reps`` means over ``n`` back-to-back calls, after a warm-up."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / n * 1e3)
    return best


def check(interpret: bool, gpu: bool) -> list[dict]:
    """Relative RMS errors of ours (and cuDNN) vs the float32 XLA reference, forward and dq, dk, dv."""
    rows = []
    for B, T, H, dqk, dv, dtype, causal in CHECKS:
        q, k, v, do = inputs(B, T, H, dqk, dv, dtype)
        impls = {"pallas": lambda q, k, v, c=causal: flash.flash_attention(q, k, v, causal=c, interpret=interpret)}
        if gpu and cudnn.cudnn_head_dim(q, v) is not None:
            impls["cudnn"] = lambda q, k, v, c=causal: cudnn.cudnn_attention(q, k, v, causal=c)
        with jax.default_matmul_precision("highest"):
            f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
            o_ref, vjp = jax.vjp(lambda q, k, v: reference.naive_attention(q, k, v, causal=causal), *f32[:3])
            g_ref = vjp(f32[3])
        for name, attn in impls.items():
            try:
                o, vjp = jax.vjp(jax.jit(attn), q, k, v)
                errs = [rel_err(o, o_ref)] + [rel_err(g, r) for g, r in zip(vjp(do), g_ref, strict=True)]
            except Exception as e:  # recorded, so that one failing case does not hide the rest
                print(f"check {name} B{B} T{T} qk{dqk} v{dv} {jnp.dtype(dtype).name}: failed {str(e)[:300]}")
                rows.append(dict(impl=name, shape=[B, T, H, dqk, dv], dtype=jnp.dtype(dtype).name, error=str(e)))
                continue
            rows.append(
                dict(
                    impl=name,
                    shape=[B, T, H, dqk, dv],
                    dtype=jnp.dtype(dtype).name,
                    causal=causal,
                    fwd=errs[0],
                    dq=errs[1],
                    dk=errs[2],
                    dv=errs[3],
                )
            )
            print(
                f"check {name:6s} B{B} T{T} H{H} qk{dqk} v{dv} {jnp.dtype(dtype).name:8s} causal={causal}: "
                + " ".join(f"{n} {e:.1e}" for n, e in zip(("o", "dq", "dk", "dv"), errs, strict=True)),
                flush=True,
            )
    return rows


def sweep(shape, interpret: bool, budget_s: float) -> tuple[tuning.AttentionConfig, list[tuple[str, float, str]]]:
    """Coordinate descent over CANDIDATES (fwd by forward time, then dkdv and dq by forward+backward time)."""
    B, T, H, dqk, dv = shape
    q, k, v, do = inputs(B, T, H, dqk, dv, jnp.bfloat16)
    best = tuning.attention_config(None, flash._pow2(max(dqk, dv)))
    log = []
    start = time.perf_counter()
    for kernel in ("fwd", "dkdv", "dq"):
        times = {}
        for cand in CANDIDATES[kernel]:
            if time.perf_counter() - start > budget_s:
                break
            cfg = dataclasses.replace(best, **{kernel: cand})
            fwd, grad = fwd_and_grad(
                lambda q, k, v, c=cfg: flash.flash_attention(q, k, v, config=c, interpret=interpret)
            )
            try:
                ms = bench(fwd, q, k, v, n=10, reps=2) if kernel == "fwd" else bench(grad, q, k, v, do, n=10, reps=2)
            except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
                print(f"sweep {kernel} {cand}: failed {str(e)[:120]}", flush=True)
                continue
            times[cand] = ms
            log.append((kernel, ms, repr(cand)))
            print(f"sweep D{max(dqk, dv)} {kernel} {cand}: {ms:.3f} ms", flush=True)
        if times:
            best = dataclasses.replace(best, **{kernel: min(times, key=times.get)})
    return best, log


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks attention", description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="try CANDIDATES and time the best beside the table")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (interpreted when no GPU)")
    parser.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    interpret = not gpu
    shapes = {n: (1, 128, 2, dqk, dv) for n, (_, _, _, dqk, dv) in SHAPES.items()} if args.smoke else SHAPES
    if args.smoke:
        CHECKS[:] = [(1, 100, 2, 48, 32, jnp.bfloat16, True)]
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, jax=jax.__version__, arch=tuning.current_arch(), checks=check(interpret, gpu))

    def dump():
        record.save("attention", result, out=args.out)

    dump()
    configs = {}  # head dim class -> {label: AttentionConfig}
    for shape in shapes.values():
        d = flash._pow2(max(shape[3:]))
        configs.setdefault(d, {"table": tuning.attention_config(None, d)})
        if args.sweep and "best" not in configs[d]:
            configs[d]["best"], result[f"sweep_D{d}"] = sweep(shape, interpret, budget_s=50)
            result[f"best_D{d}"] = repr(configs[d]["best"])
            dump()
    print(f"\n{dev.device_kind}, jax {jax.__version__}, causal bf16; ms per call (fwd / fwd+bwd)", flush=True)
    timings = result["timings"] = {}
    for name, (B, T, H, dqk, dv) in shapes.items():
        q, k, v, do = inputs(B, T, H, dqk, dv, jnp.bfloat16)
        impls = {
            f"pallas_{label}": (lambda q, k, v, c=cfg: flash.flash_attention(q, k, v, config=c, interpret=interpret))
            for label, cfg in configs[flash._pow2(max(dqk, dv))].items()
        }
        if gpu:
            impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
            impls["auto"] = lambda q, k, v: kernels.attention(q, k, v, impl="auto")
        row = timings[name] = {"auto_choice": cudnn.auto_impl(q, v)}
        for label, attn in impls.items():
            fwd, grad = fwd_and_grad(attn)
            try:
                row[label] = (bench(fwd, q, k, v), bench(grad, q, k, v, do))
            except Exception as e:
                print(f"{name} {label}: failed {str(e)[:200]}", flush=True)
                continue
            print(f"{name:24s} {label:14s} {row[label][0]:7.3f} / {row[label][1]:7.3f}", flush=True)
        if "cudnn" in row:
            for label in [x for x in impls if x.startswith("pallas") and x in row]:
                row[f"{label}_over_cudnn"] = tuple(a / b for a, b in zip(row[label], row["cudnn"], strict=True))
                print(
                    f"{name:24s} {label} / cudnn: {row[f'{label}_over_cudnn'][0]:.2f}x / "
                    f"{row[f'{label}_over_cudnn'][1]:.2f}x",
                    flush=True,
                )
        dump()


if __name__ == "__main__":
    main()
