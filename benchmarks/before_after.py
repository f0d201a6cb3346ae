"""Our recurrent kernels and the loss kernel from another tree (``--tree``, e.g. a checkout of the commit before a
change) beside this tree's, in one process on the same inputs: fwd and fwd+bwd ms of each, their ratio, and whether
the outputs and gradients are bit for bit the same.

    git worktree add /tmp/before HEAD~1   # or git archive ... | tar -x -C /tmp/before
    python -m benchmarks before_after --tree /tmp/before [--only gdn_anchor ...] [--rounds 3] [--repeats 10]

The other tree's ``kernels/`` is copied to a temporary package (its ``hybrid_jax.kernels`` imports renamed; a tree
of the layout before ``hybrid_jax/kernels.py`` has its own ``kernels/__init__.py``, one after gets an ``__init__.py``
that imports the public functions from its ``api.py``) and called through its public functions
(``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_simple_gla`` with ``impl="pallas"``), each tree with its own
tuning table for this GPU, on the inputs ``benchmarks kernels`` times. ``loss_300m`` is the loss kernel
(``cross_entropy.softmax_grad``) at the 300M recipe's chunk (logits [4096, 128256] bf16; one column, no backward).
Timings alternate between the trees over ``--rounds`` rounds (median of each tree's rounds), so that drift in the
GPU's clock hits both alike. Writes the record ``before_after``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import pathlib
import shutil
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import record
from benchmarks.shapes import SHAPES
from hybrid_jax import kernels as this_tree
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.timing import median_ms

PACKAGE = "kernels_of_the_other_tree"
LOSS_CHUNK = {"loss_300m": (4096, 128256)}  # (rows C, vocabulary V) of the loss kernel's case


def import_kernels(tree: pathlib.Path, into: pathlib.Path):
    """``tree/kernels`` as the package :data:`PACKAGE` (copied under ``into``, imports renamed). Either layout: the
    folder a package of its own (``kernels/__init__.py``), or the folder of ``hybrid_jax/kernels.py``'s package."""
    source = tree / "kernels"
    old_layout = (source / "__init__.py").is_file()
    if not old_layout and not ((tree / "hybrid_jax" / "kernels.py").is_file() and (source / "api.py").is_file()):
        raise SystemExit(f"--tree {tree}: neither kernels/__init__.py nor hybrid_jax/kernels.py with kernels/api.py "
                         "there; give the root of a hybrid_jax checkout")
    target = into / PACKAGE
    shutil.copytree(source, target)
    for path in target.rglob("*.py"):
        text = path.read_text().replace("from hybrid_jax import kernels", f"import {PACKAGE} as kernels")
        path.write_text(text.replace("hybrid_jax.kernels", PACKAGE))
    if not old_layout:
        (target / "__init__.py").write_text(f"from {PACKAGE}.api import (attention, chunk_gated_delta_rule, "
                                            "chunk_kda, chunk_simple_gla)  # noqa: F401\n")
    sys.path.insert(0, str(into))
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]  # another tree's, imported earlier in this process
    return importlib.import_module(PACKAGE)


def functions(api, s: Problem, impl: str):
    """(forward, forward+backward) jitted on the input dict, through ``api``'s public function for ``s``."""
    op = getattr(api, OPS[s.op].function)

    def fwd(x):
        extra = (x["beta"],) if s.delta else ()
        kw = {"use_qk_l2norm": True} if s.delta else {}
        return op(x["q"], x["k"], x["v"], x["g"], *extra, impl=impl, **kw)[0]

    def fwd_bwd(x, do):
        o, vjp = jax.vjp(fwd, x)
        return o, vjp(do.astype(o.dtype))[0]

    return jax.jit(fwd), jax.jit(fwd_bwd)


def alternate(calls: dict[str, tuple], outputs: dict[str, tuple], rounds: int, repeats: int) -> dict:
    """Time ``calls`` (``name: (jitted f, args)``, each name ``<tree>_<part>_ms``) in turn over ``rounds``: each
    name's median ms, the ``fwd``/``fwdbwd`` ratios of ``after`` over ``before``, the samples, and whether the two
    trees' ``outputs`` (``"before"``/``"after"``: ``(f, args)``) are bit for bit the same."""
    leaves = [jax.tree.leaves(f(*args)) for f, args in (outputs["before"], outputs["after"])]
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves, strict=True))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (f, args) in calls.items():
            times[name].append(median_ms(f, *args, repeats=repeats))
    res = {name: statistics.median(v) for name, v in times.items()}
    for part in ("fwd", "fwdbwd"):
        if f"after_{part}_ms" in res:
            res[f"{part}_ratio"] = res[f"after_{part}_ms"] / res[f"before_{part}_ms"]
    res.update(bitwise_same=same, rounds=times)
    return res


def compare(s: Problem, before, rounds: int, repeats: int, impl: str = "pallas") -> dict:
    """Both trees' fwd and fwd+bwd ms at ``s`` (FLA-law inputs, as ``benchmarks kernels``), alternating over
    ``rounds``, their ratios, and whether outputs and gradients are bit for bit the same."""
    x = inputs(s, law="fla", initial_state=False)
    do = cotangents(s)[0]
    fns = {"before": functions(before, s, impl), "after": functions(this_tree, s, impl)}
    calls = {}
    for tree, (f, fb) in fns.items():
        calls.update({f"{tree}_fwd_ms": (f, (x,)), f"{tree}_fwdbwd_ms": (fb, (x, do))})
    return alternate(calls, {tree: (fb, (x, do)) for tree, (_, fb) in fns.items()}, rounds, repeats)


def compare_loss(C: int, V: int, before, rounds: int, repeats: int, impl: str = "pallas") -> dict:
    """Both trees' loss kernel (``softmax_grad``) on logits ``[C, V]`` bf16, alternating over ``rounds``: ms,
    ratio, and whether ``dlogits`` and the log-sum-exp are bit for bit the same."""
    other = importlib.import_module(f"{before.__name__}.cross_entropy")
    from hybrid_jax.kernels import cross_entropy

    kx, kt, kw = jax.random.split(jax.random.key(0), 3)
    x = (4.0 * jax.random.normal(kx, (C, V))).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (C,), 0, V)
    w = jax.random.uniform(kw, (C,), minval=0.5, maxval=2.0)
    fns = {tree: (jax.jit(lambda x, t, w, m=m: m.softmax_grad(x, t, w, impl=impl)), (x, t, w))
           for tree, m in (("before", other), ("after", cross_entropy))}
    return alternate({f"{tree}_fwd_ms": call for tree, call in fns.items()}, fns, rounds, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks before_after", description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True, type=pathlib.Path, help="the other checkout's root")
    ap.add_argument("--only", nargs="+", default=None, choices=[s.name for s in SHAPES] + list(LOSS_CHUNK))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (checks the tool on CPU)")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv)
    losses = [name for name in LOSS_CHUNK if not args.only or name in args.only]
    if not (args.tree / "kernels").is_dir():
        ap.error(f"--tree {args.tree}: no kernels/ folder there; give the root of a hybrid_jax checkout")
    if losses and not (args.tree / "kernels" / "cross_entropy.py").is_file():
        ap.error(f"--tree {args.tree} has no kernels/cross_entropy.py (the loss kernel came later): "
                 f"leave {losses[0]} out with --only")
    impl = "pallas_interpret" if args.smoke else "pallas"
    shapes = [dataclasses.replace(s, B=1, T=64, H=1, HV=s.HV // s.H, K=16, V=16) if args.smoke else s
              for s in SHAPES if not args.only or s.name in args.only]
    with tempfile.TemporaryDirectory() as tmp:
        before = import_kernels(args.tree.resolve(), pathlib.Path(tmp))
        cases = [(s.name, functools.partial(compare, s, before, args.rounds, args.repeats, impl)) for s in shapes]
        cases += [(name, functools.partial(compare_loss, *((8, 1000) if args.smoke else LOSS_CHUNK[name]), before,
                                           args.rounds, args.repeats, impl)) for name in losses]
        results, path = {}, None
        print(f"{'shape':<12} {'before f':>9} {'after f':>9} {'ratio':>6} {'before fb':>10} {'after fb':>9} "
              f"{'ratio':>6}  bitwise", flush=True)
        for name, run in cases:
            r = results[name] = run()
            fb = (f"{r['before_fwdbwd_ms']:10.3f} {r['after_fwdbwd_ms']:9.3f} {r['fwdbwd_ratio']:6.3f}"
                  if "fwdbwd_ratio" in r else f"{'-':>10} {'-':>9} {'-':>6}")  # the loss kernel: no backward
            print(f"{name:<12} {r['before_fwd_ms']:9.3f} {r['after_fwd_ms']:9.3f} {r['fwd_ratio']:6.3f} {fb}  "
                  f"{r['bitwise_same']}", flush=True)
            path = record.save("before_after", {"tree": str(args.tree), "shapes": results}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
