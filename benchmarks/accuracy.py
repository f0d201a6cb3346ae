"""bf16 accuracy of our recurrent kernels and of FLA's on the same inputs, against one float32 reference.

    python -m benchmarks run 'accuracy --side ours --config configs/zebra_300m_kda.py' \\
                             'accuracy --side fla --config configs/zebra_300m_kda.py'

``--side ours`` (JAX): the kernel calls of each config (``hybrid_jax.model.kernel_calls``: the model's shapes, batch
2, T 2048) with bf16 inputs with the model's gates (``kernels/tooling/inputs.py``); the float32 chunked XLA form at
the highest matmul precision is the reference. It writes the inputs, the cotangents and the reference's outputs and
gradients to ``--scratch/<case>.npz`` (default ``/tmp/accuracy``; tens of MB, not part of the record) and the record
``accuracy_ours``: the relative RMS error of our Pallas kernels' output, final state and every input's gradient.
``--side fla`` (PyTorch, a process of its own) reads those files, runs
FLA's kernel on the same bf16 inputs (q/k L2-normalised in the kernel, grouped value heads by repeating q/k, as
FLA's models do) and writes ``accuracy_fla`` with the same errors. FLA refuses its gated backward on Hopper under
Triton < 3.7.1 (a miscompile guard); it is lifted here, so FLA's gradient errors on such a GPU are reported, not
relied on: the forward is the comparison.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from benchmarks import record
from hybrid_jax.kernels.tooling.errors import rel_rms  # imports JAX, starts no backend (the FLA side's process)

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _errors(out: dict, ref: dict) -> dict[str, float]:
    return {n: float(f"{rel_rms(out[n], ref[f'ref_{n}']):.3g}") for n in out}


def ours(configs: list[str], folder: pathlib.Path) -> dict:
    import jax
    import jax.numpy as jnp

    from hybrid_jax.config import load_config_file
    from hybrid_jax.kernels.tooling.calls import fwd_bwd, reference_run
    from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
    from hybrid_jax.model.kernel_calls import problems_of

    figures = {}
    for path in configs:
        for p in problems_of(load_config_file(path), batch=2, seq_len=2048, max_heads=None):
            stem = f"{p.op}_H{p.H}_{p.HV}_K{p.K}_V{p.V}"
            if p.op == "attention" or stem in figures:
                continue
            x, ct = inputs(p), cotangents(p)
            (o, final), grads = jax.jit(fwd_bwd(p, "pallas"))(x, ct)
            (ro, rfinal), rgrads = reference_run(p, "xla", x, ct)
            ref = {"ref_o": ro, "ref_final_state": rfinal, **{f"ref_d{n}": rgrads[n] for n in rgrads}}
            got = {"o": o, "final_state": final, **{f"d{n}": grads[n] for n in grads}}
            arrays = {n: np.asarray(jnp.asarray(a, jnp.float32)) for n, a in {**x, **ref}.items()}
            np.savez(folder / f"{stem}.npz", do=np.asarray(
                ct[0].astype(jnp.float32)), dfinal=np.asarray(ct[1]), scale=np.float32(p.scale or 0.0), **arrays)
            figures[stem] = {"shape": p.shape, "chunk": p.chunk or "tuned",
                             "errors": _errors({n: np.asarray(a.astype(jnp.float32)) for n, a in got.items()},
                                               {k: np.asarray(v) for k, v in ref.items()})}
            print(f"{stem:<24} ours {figures[stem]['errors']}", flush=True)
    return figures


def fla(folder: pathlib.Path, out: str | None) -> dict:
    from benchmarks.fla_reference import lift_hopper_guard

    lift_hopper_guard()
    figures = {}
    for path in sorted(folder.glob("*.npz")):
        try:
            figures[path.stem] = {"errors": _fla_errors(path)}
        except Exception as e:  # noqa: BLE001 - one case FLA cannot run must not hide the others
            figures[path.stem] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        print(f"{path.stem:<24} fla {figures[path.stem]}", flush=True)
        record.save("accuracy_fla", figures, out=out)  # after each case: FLA's autotuning may meet a time limit
    return figures


def _fla_errors(path: pathlib.Path) -> dict[str, float]:
    """FLA's kernel on the inputs of one ``--side ours`` file: its errors against the file's reference."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from fla.ops.simple_gla import chunk_simple_gla

    f = np.load(path)
    op = path.name.split("_")[0]
    dev = lambda name, dtype: torch.tensor(f[name], device="cuda").to(dtype).requires_grad_()  # noqa: E731
    bf16 = torch.bfloat16
    x = {"q": dev("q", bf16), "k": dev("k", bf16), "v": dev("v", bf16), "g": dev("g", torch.float32),
         "initial_state": dev("initial_state", torch.float32)}
    if "beta" in f:
        x["beta"] = dev("beta", bf16)
    group = x["v"].shape[2] // x["q"].shape[2]
    heads = (lambda t: t.repeat_interleave(group, dim=2)) if group > 1 else (lambda t: t)  # noqa: E731
    scale = float(f["scale"]) or None
    kw = dict(scale=scale, initial_state=x["initial_state"], output_final_state=True)
    if op == "gla":
        o, final = chunk_simple_gla(heads(x["q"]), heads(x["k"]), x["v"], x["g"], **kw)
    else:
        fn = chunk_kda if op == "kda" else chunk_gated_delta_rule
        o, final = fn(heads(x["q"]), heads(x["k"]), x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True, **kw)
    do = torch.tensor(f["do"], device="cuda").to(bf16)
    torch.autograd.backward([o, final], [do, torch.tensor(f["dfinal"], device="cuda")])
    got = {"o": o, "final_state": final, **{f"d{n}": x[n].grad for n in GRAD_NAMES if n in x}}
    got = {n: t.detach().float().cpu().numpy() for n, t in got.items()}
    return _errors(got, f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=("ours", "fla"), required=True)
    ap.add_argument("--config", action="append", default=[], help="a run config (repeatable; --side ours)")
    ap.add_argument("--scratch", default="/tmp/accuracy", help="where the sides exchange inputs and references")
    ap.add_argument("--out", default=None, help="the records' folder (default $OUT)")
    args = ap.parse_args(argv)
    folder = pathlib.Path(args.scratch)
    folder.mkdir(parents=True, exist_ok=True)
    figures = ours(args.config, folder) if args.side == "ours" else fla(folder, args.out)
    record.save(f"accuracy_{args.side}", figures, out=args.out)
