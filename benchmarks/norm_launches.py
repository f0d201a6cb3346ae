"""A launch sweep of the row-norm kernels at a config's training shapes: each launch alone, forward and
forward+backward, beside the current one (``kernels.tuning.NormConfig()``), for choosing ``NormConfig`` on a GPU.

    python -m benchmarks norm_launches [--config configs/zebra_300m_gdn.py] [--batch 32] [--warps 4 8 16]
        [--blocks 1024 2048 4096] [--programs 528 1024 2048] [--repeats 15] [--smoke]

The ops, on ``batch x seq_len`` rows of random bf16 inputs: ``add_rms_norm`` (the residual stream's add with the
RMSNorm after it, ``[N, hidden]``, both outputs' cotangents), GDN's gated norm (groups of the value head dim, one
shared weight, gate after) and Mamba2's (its groups, a weight per channel, gate first). A launch is
``NormConfig(block, programs, Launch(warps, 1))``: the forward kernels take ``block`` and ``warps`` (timed once per
pair), the backward all three. Each launch's forward output and gradients are checked against XLA's (``impl="xla"``)
before it is timed (median of samples of back-to-back calls). Prints the best launches per op and saves the record
``norm_launches``: every launch's times and their ratio to the current launch's. ``--smoke``: the demo config at 1 x
64 in interpret mode on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks import record
from hybrid_jax.config import load_config_file
from hybrid_jax.kernels import tuning
from hybrid_jax.kernels.gated_norm import gated_rms_norm
from hybrid_jax.kernels.rms_norm import add_rms_norm
from hybrid_jax.kernels.tooling.timing import median_ms

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Largest |kernel - XLA| of an output or gradient over the largest |XLA| (bf16 rounding: about 0.008). Worst element,
# not kernels.tooling.errors' relative RMS: a launch gone wrong breaks a tile's rows (a mask, a ragged tile), which a
# norm over 65,536 rows would average away.
TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class NormOp:
    """``fn(*inputs, impl=...)``, differentiated in every input; ``shape`` for the table."""

    name: str
    shape: str
    fn: Callable[..., jax.Array | tuple[jax.Array, ...]]
    inputs: tuple[jax.Array, ...]


def make_ops(cfg, rows: int) -> list[NormOp]:
    """The three norms of the module docstring at ``rows`` token rows of ``cfg.model``."""
    m = cfg.model
    eps, bf16 = m.norm_eps, jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0), 12))

    def rand(*shape, dtype=bf16):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)

    D, hv, dv = m.hidden_size, m.gdn.num_value_heads, m.gdn.value_head_dim
    d_in, groups = m.mamba2.expand * D, m.mamba2.num_groups
    return [
        NormOp("add_rms_norm", f"[{rows},{D}] x2", lambda x, y, w, impl: add_rms_norm(
            x, y, w, eps=eps, out_dtype=bf16, impl=impl),
            (rand(rows, D), rand(rows, D), 1 + rand(D, dtype=jnp.float32))),
        NormOp("gdn_gated_norm", f"[{rows},{hv}x{dv}] x2", lambda x, z, w, impl: gated_rms_norm(
            x, z, w, groups=hv, gate_first=False, eps=eps, out_dtype=bf16, impl=impl),
            (rand(rows, hv * dv), rand(rows, hv * dv), 1 + rand(dv, dtype=jnp.float32))),
        NormOp("mamba2_gated_norm", f"[{rows},{d_in}] x2 G={groups}", lambda x, z, w, impl: gated_rms_norm(
            x, z, w, groups=groups, gate_first=True, eps=eps, out_dtype=bf16, impl=impl),
            (rand(rows, d_in), rand(rows, d_in), 1 + rand(d_in, dtype=jnp.float32))),
    ]


def compiled(op: NormOp, impl: str, launch: tuning.NormConfig, dy=None) -> Callable:
    """``op`` by ``impl`` compiled with ``launch`` as the norms' config: ``fwd(*inputs)``, or with ``dy``
    ``fwd_bwd(dy, *inputs) -> (outputs, gradients)``."""

    def fwd_bwd(dy, *x):
        y, vjp = jax.vjp(lambda *a: op.fn(*a, impl=impl), *x)
        return y, vjp(dy)

    with mock.patch.object(tuning, "NormConfig", lambda: launch):
        if dy is None:
            return jax.jit(lambda *x: op.fn(*x, impl=impl)).lower(*op.inputs).compile()
        return jax.jit(fwd_bwd).lower(dy, *op.inputs).compile()


def worst_error(got, want) -> float:
    """The largest ``|got - want|`` over the largest ``|want|``, per array, the worst of all arrays."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                     / max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))), 1e-30)) for g, w in pairs)


def sweep(op: NormOp, launches: list[tuning.NormConfig], impl: str, repeats: int) -> list[dict]:
    """Every launch of ``launches`` on ``op``: its times and its error against XLA (a ValueError past
    :data:`TOLERANCE`)."""
    y = jax.eval_shape(lambda *x: op.fn(*x, impl="xla"), *op.inputs)
    keys = iter(jax.random.split(jax.random.key(1), 8))
    dy = jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, jnp.float32).astype(s.dtype), y)
    want = compiled(op, "xla", tuning.NormConfig(), dy)(dy, *op.inputs)
    rows, fwd_ms = [], {}  # the forward takes no programs count: timed once per (warps, block)
    for launch in launches:
        fwd_bwd = compiled(op, impl, launch, dy)
        err = worst_error(fwd_bwd(dy, *op.inputs), want)
        label = f"w{launch.launch.num_warps} b{launch.block} p{launch.programs}"
        if err > TOLERANCE:
            raise ValueError(f"norm_launches: {op.name} at {label} differs from XLA by {err:.3g} of its largest value")
        key = (launch.launch.num_warps, launch.block)
        if key not in fwd_ms:
            fwd_ms[key] = median_ms(compiled(op, impl, launch), *op.inputs, repeats=repeats)
        rows.append(dict(op=op.name, shape=op.shape, launch=label, warps=launch.launch.num_warps, block=launch.block,
                         programs=launch.programs, error=err, fwd_ms=fwd_ms[key],
                         fwdbwd_ms=median_ms(fwd_bwd, dy, *op.inputs, repeats=repeats)))
        print(f"{op.name:<18} {label:<16} fwd {rows[-1]['fwd_ms']:8.4f} ms  fwd+bwd {rows[-1]['fwdbwd_ms']:8.4f} ms  "
              f"error {err:.2g}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks norm_launches", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIGS / "zebra_300m_gdn.py", help="config file (shapes)")
    ap.add_argument("--batch", type=int, default=32, help="micro-batch size (sequences)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096], help="elements per tile")
    ap.add_argument("--programs", type=int, nargs="+", default=[528, 1024, 2048], help="backward programs at most")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="the demo config at 1 x 64, interpret mode (checks the tool)")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = ap.parse_args(argv)
    if any(n < 1 or n & (n - 1) for n in (*args.warps, *args.blocks)) or min(args.programs) < 1:
        ap.error(f"--warps and --blocks take powers of two, --programs positive counts; got {args.warps}, "
                 f"{args.blocks} and {args.programs}")
    cfg = load_config_file(CONFIGS / "demo.py" if args.smoke else args.config)
    batch, seq = (1, 64) if args.smoke else (args.batch, cfg.train.seq_len)
    current = tuning.NormConfig()
    launches = [current] + [
        c for c in (tuning.NormConfig(block=b, programs=p, launch=tuning.Launch(w, 1))
                    for w, b, p in itertools.product(args.warps, args.blocks, args.programs)) if c != current]
    impl = "pallas_interpret" if args.smoke else "pallas"
    print(f"device {jax.devices()[0].device_kind}  config {cfg.model.name}  rows {batch} x {seq}  {impl}  "
          f"{len(launches)} launches, the first the current one", flush=True)
    repeats = 1 if args.smoke else args.repeats
    rows = [r for op in make_ops(cfg, batch * seq) for r in sweep(op, launches, impl, repeats)]
    best = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        for r in mine:
            r.update(fwd_over_current=r["fwd_ms"] / mine[0]["fwd_ms"],
                     fwdbwd_over_current=r["fwdbwd_ms"] / mine[0]["fwdbwd_ms"])
        top = min(mine, key=lambda r: r["fwdbwd_ms"])
        best[op] = dict(launch=top["launch"], fwdbwd_over_current=top["fwdbwd_over_current"])
        print(f"{op}: best forward+backward {top['launch']} at {top['fwdbwd_over_current']:.3f}x the current "
              f"launch ({mine[0]['launch']}: {mine[0]['fwdbwd_ms']:.4f} ms)", flush=True)
    record.save("norm_launches", dict(config=cfg.model.name, rows_per_op=batch * seq, impl=impl,
                                      current=rows[0]["launch"], best=best, launches=rows), out=args.out)


if __name__ == "__main__":
    main()
