"""Packed documents (``segment_ids``): the recurrent kernels and flash attention, fwd+bwd, with a document boundary
every ``--every`` tokens against none, at the shapes of ``benchmarks/shapes.py``; prints the ratio per shape (for
the recurrent kernels the median of ``--rounds`` rounds that time the two in turn, and the rounds' range).

    python -m benchmarks documents [--every 512] [--only gdn_300m kda_300m] [--stages] [--profile] [--smoke]
    ncu -k 'regex:^(state_bwd|grad_bwd)$' --launch-skip 2 --launch-count 2 python -m benchmarks documents \
        --only kda_300m --calls-only documents     (and --calls-only none)

``--profile``: also the device time per call of each launch and XLA op, with and without documents (a profiler
trace of a few calls), largest difference first. ``--stages``: also each recurrent launch stage alone
(``benchmarks.kernels.stage_times``) with no documents, a boundary every ``--every`` tokens, and one in every chunk
(every chunk takes the masked form).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.kernels import stage_times
from benchmarks.shapes import ATTENTION_SHAPES, SHAPES, Shape
from benchmarks.timing import median_ms
from benchmarks.trace_summary import summarize
from hybrid_jax.kernels import api
from hybrid_jax.kernels.tuning import recurrent_config, recurrent_op


def _fwd_bwd(fn, *args):
    """``fn(*args) -> o``, jitted: the forward's value and the gradient of every float input (the value too, as in
    training: under ``jax.grad`` alone XLA drops a launch whose only output is ``o``)."""
    floats = tuple(i for i, x in enumerate(args) if x is not None and jnp.issubdtype(x.dtype, jnp.floating))

    def loss(*xs):
        full = list(args)
        for i, x in zip(floats, xs, strict=True):
            full[i] = x
        return jnp.sum(fn(*full).astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(floats))))), [args[i] for i in floats]


def recurrent_fwd_bwd(shape: Shape, segment_ids, impl: str):
    """-> the jitted fwd+bwd of the recurrent op at ``shape`` (bf16 inputs) and its float inputs."""
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    q, k = (jax.random.normal(x, (B, T, H, K), jnp.bfloat16) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.bfloat16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, HV, K) if shape.per_key else (B, T, HV)) + 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV))).astype(jnp.bfloat16) if shape.delta else None
    op = api.chunk_kda if shape.per_key else api.chunk_gated_delta_rule if shape.delta else None

    def fn(q, k, v, g, beta):
        if op is None:
            return api.chunk_simple_gla(q, k, v, g, impl=impl, segment_ids=segment_ids)[0]
        return op(q, k, v, g, beta, use_qk_l2norm=True, impl=impl, segment_ids=segment_ids)[0]

    return _fwd_bwd(fn, q, k, v, g, beta)


def alternating_ms(fns: list, repeats: int, rounds: int) -> list[tuple[float, ...]]:
    """The ms of each ``(jitted fn, inputs)`` of ``fns``, timed in turn ``rounds`` times (each a :func:`median_ms`
    of ``repeats`` samples), so that a drift of the GPU's clock hits them alike: one tuple per round."""
    return [tuple(median_ms(fn, *xs, repeats=repeats) for fn, xs in fns) for _ in range(rounds)]


def launch_us(grad, xs, folder: Path, calls: int = 5) -> dict[str, float]:
    """Device time per call of ``grad(*xs)`` (compiled) of each kernel and XLA op (us; a ``jax.profiler`` trace of
    ``calls`` calls under ``folder``), keyed by op name."""
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(grad(*xs))
    ops = summarize(folder, top=1000)["ops"]
    return {o["name"]: 1e3 * o["ms"] / calls for o in ops}


def attention_ms(dims, segment_ids, impl: str, repeats: int) -> float:
    B, T, H, dqk, dv = dims
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k = (jax.random.normal(x, (B, T, H, dqk), jnp.bfloat16) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, dv), jnp.bfloat16)
    grad, xs = _fwd_bwd(lambda q, k, v: api.attention(q, k, v, impl=impl, segment_ids=segment_ids), q, k, v)
    return median_ms(grad, *xs, repeats=repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=512, help="tokens per document")
    ap.add_argument("--only", nargs="*", default=None, help="shape names (benchmarks/shapes.py) to run")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="recurrent kernels: time without and with documents in turn this many times; the ratio is "
                         "the median of the rounds'")
    ap.add_argument("--no-attention", action="store_true", help="the recurrent kernels only")
    ap.add_argument("--stages", action="store_true", help="also time each recurrent launch stage alone")
    ap.add_argument("--profile", action="store_true",
                    help="also each launch's and XLA op's device time per call (a profiler trace), with and without")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (checks the script on CPU)")
    ap.add_argument("--calls-only", choices=["none", "documents"], default=None,
                    help="instead, call each shape's fwd+bwd twice without or with the documents, for an outside "
                         "profiler (ncu --launch-skip: the first call's launches)")
    args = ap.parse_args(argv)
    impl = "pallas_interpret" if args.smoke else "auto"
    shapes = [s for s in SHAPES if args.only is None or s.name in args.only]
    if args.smoke:
        shapes = [Shape(s.name, 1, 64, 1, 2, 16, 16, s.delta, s.per_key) for s in shapes[:3]]
    rows = []
    for shape in shapes:
        seg = jnp.broadcast_to(jnp.arange(shape.T, dtype=jnp.int32) // min(args.every, shape.T), (shape.B, shape.T))
        if args.calls_only:
            grad, xs = recurrent_fwd_bwd(shape, seg if args.calls_only == "documents" else None, impl)
            for _ in range(2):
                jax.block_until_ready(grad(*xs))
            print(f"called {shape.name} twice, {args.calls_only}", flush=True)
            continue
        fns = [recurrent_fwd_bwd(shape, ids, impl) for ids in (None, seg)]
        times = alternating_ms(fns, args.repeats, args.rounds)
        ratios = sorted(d / n for n, d in times)
        none, docs = (statistics.median(t[i] for t in times) for i in (0, 1))
        rows.append(dict(part="recurrent", shape=shape.name, none_ms=none, documents_ms=docs,
                         ratio=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1], rounds=times))
        print(f"recurrent  {shape.name}: x{statistics.median(ratios):.3f} (rounds x{ratios[0]:.3f} - "
              f"x{ratios[-1]:.3f})", flush=True)
        if args.profile:
            with tempfile.TemporaryDirectory() as tmp:
                none, docs = (launch_us(*fn, Path(tmp) / name) for fn, name in zip(fns, ("none", "docs"), strict=True))
            for op in sorted(set(none) | set(docs), key=lambda o: -abs(docs.get(o, 0.0) - none.get(o, 0.0))):
                rows.append(dict(part="launch", shape=f"{shape.name}.{op}", none_ms=none.get(op, 0.0) / 1e3,
                                 documents_ms=docs.get(op, 0.0) / 1e3))
        if args.stages:
            cfg = recurrent_config(per_key=shape.per_key, op=recurrent_op(shape.per_key, shape.delta),
                                   dims=(shape.K, shape.V))
            every = min(args.every, shape.T)
            none, docs, each = (stage_times(shape, cfg, args.repeats, interpret=args.smoke, every=e)
                                for e in (None, every, cfg.chunk))
            rows += [dict(part="stage", shape=f"{shape.name}.{n}", none_ms=none[n], documents_ms=docs[n],
                          ratio=docs[n] / none[n], every_chunk_ms=each[n]) for n in none]
    if args.calls_only:
        return
    attention = {} if args.no_attention else {"smoke": (1, 64, 2, 16, 16)} if args.smoke else ATTENTION_SHAPES
    for name, dims in attention.items():
        B, T = dims[:2]
        seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // min(args.every, T), (B, T))
        none, docs = (attention_ms(dims, s, impl, args.repeats) for s in (None, seg))
        rows.append(dict(part="attention", shape=name, none_ms=none, documents_ms=docs, ratio=docs / none))
    for row in rows:
        if row["part"] == "launch":
            print(f"launch     {row['shape'][:60]:<60} none {1e3 * row['none_ms']:8.1f} us  documents "
                  f"{1e3 * row['documents_ms']:8.1f} us  {1e3 * (row['documents_ms'] - row['none_ms']):+7.1f} us")
            continue
        every_chunk = f"  every chunk {row['every_chunk_ms']:8.3f} ms" if "every_chunk_ms" in row else ""
        spread = f" (x{row['ratio_min']:.3f} - x{row['ratio_max']:.3f})" if "ratio_min" in row else ""
        print(f"{row['part']:<10} {row['shape']:<24} none {row['none_ms']:8.3f} ms  documents every {args.every}: "
              f"{row['documents_ms']:8.3f} ms  x{row['ratio']:.3f}{spread}{every_chunk}", flush=True)
    print(json.dumps(dict(every=args.every, device=jax.devices()[0].device_kind, rows=rows)))


if __name__ == "__main__":
    main()
