"""Packed documents (``segment_ids``): the recurrent kernels and flash attention, fwd+bwd, with a document boundary
every ``--every`` tokens against none, at the shapes of ``benchmarks/shapes.py``; prints the ratio per shape (for
the recurrent kernels the median of ``--rounds`` rounds that time the two in turn, and the rounds' range).

    python -m benchmarks documents [--every 512] [--only gdn_300m kda_300m] [--stages] [--profile] [--smoke]
    ncu -k 'regex:^(state_bwd|grad_bwd)$' --launch-skip 2 --launch-count 2 python -m benchmarks documents \
        --only kda_300m --calls-only documents     (and --calls-only none)

Inputs of FLA's benchmark law, as ``benchmarks kernels`` times (``kernels/tooling/inputs.py``). ``--profile``: also
the device time per call of each launch and XLA op, with and without documents (a profiler trace of a few calls),
largest difference first. ``--stages``: also each recurrent launch stage alone (``kernels/tooling/stages.py``) with no
documents, a boundary every ``--every`` tokens, and one in every chunk (every chunk takes the masked form).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.kernels import timing_inputs
from benchmarks.shapes import ATTENTION_SHAPES, SHAPES
from benchmarks.trace_summary import summarize
from hybrid_jax.kernels.tooling.calls import call
from hybrid_jax.kernels.tooling.inputs import inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.stages import stage_times
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.kernels.tuning import recurrent_config


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


def problem_fwd_bwd(p: Problem, segment_ids, impl: str):
    """-> the jitted fwd+bwd of ``p``'s op (its inputs of FLA's law, no initial state; ``kernels/tooling``) with
    ``impl`` and ``segment_ids`` (None: no documents), and its float inputs."""
    x = inputs(p, law="fla", initial_state=False)
    names = list(x)
    return _fwd_bwd(lambda *xs: call(p, dict(zip(names, xs, strict=True)), impl, segment_ids=segment_ids)[0],
                    *x.values())


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
        shapes = [dataclasses.replace(s, B=1, T=64, H=1, HV=2, K=16, V=16) for s in shapes[:3]]
    rows = []
    for shape in shapes:
        seg = jnp.broadcast_to(jnp.arange(shape.T, dtype=jnp.int32) // min(args.every, shape.T), (shape.B, shape.T))
        if args.calls_only:
            grad, xs = problem_fwd_bwd(shape, seg if args.calls_only == "documents" else None, impl)
            for _ in range(2):
                jax.block_until_ready(grad(*xs))
            print(f"called {shape.name} twice, {args.calls_only}", flush=True)
            continue
        fns = [problem_fwd_bwd(shape, ids, impl) for ids in (None, seg)]
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
            cfg = recurrent_config(per_key=shape.per_key, op=shape.op, dims=shape.key[1:])
            every = min(args.every, shape.T)
            none, docs, each = (stage_times(shape, cfg, timing_inputs(shape, cfg, args.smoke, e)[2], args.repeats,
                                            interpret=args.smoke) for e in (None, every, cfg.chunk))
            rows += [dict(part="stage", shape=f"{shape.name}.{n}", none_ms=none[n], documents_ms=docs[n],
                          ratio=docs[n] / none[n], every_chunk_ms=each[n]) for n in none]
    if args.calls_only:
        return
    smoke = [Problem("attention", 1, 64, 2, 2, 16, 16, name="smoke")]
    for p in [] if args.no_attention else smoke if args.smoke else ATTENTION_SHAPES:
        seg = jnp.broadcast_to(jnp.arange(p.T, dtype=jnp.int32) // min(args.every, p.T), (p.B, p.T))
        none, docs = alternating_ms([problem_fwd_bwd(p, s, impl) for s in (None, seg)], args.repeats, 1)[0]
        rows.append(dict(part="attention", shape=p.name, none_ms=none, documents_ms=docs, ratio=docs / none))
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
