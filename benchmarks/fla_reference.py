"""The reference side of our kernel benchmarks: FLA's Triton kernels and PyTorch SDPA at the shapes we time.

    python -m benchmarks fla_reference [--only NAME ...] [--no-attention | --attention-only] [--out DIR]

Run it in the same device command as ``kernels`` / ``attention`` (same GPU, e.g. ``python -m benchmarks run
'kernels --only kda_anchor' 'fla_reference --only kda_anchor --no-attention'``) so the ratios compare like with
like. Inputs follow the reference's anchor script: bf16, ``k`` L2-normalised, ``g =
logsigmoid(randn) / 16`` (float32, per key channel for KDA), ``beta = sigmoid(rand)``; fwd+bwd = the gradients of
every input for a random ``do``; ``triton.testing.do_bench`` (warm-up 10, 50 ms of repeats). FLA's GDN and KDA
kernels fuse the q/k L2 norm (``use_qk_l2norm_in_kernel=True``), as ours does. Grouped value heads (``HV > H``)
are passed to FLA as its models do: q/k repeated to ``HV`` heads first (the repeat is inside the timed call).
Attention: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` with whatever backend PyTorch picks
(``[B, H, T, D]`` layout, its native one). Timing only: FLA's Hopper guard on its gated backward under
Triton < 3.7.1 is lifted, so these numbers are not correctness references. Saves the record ``fla_reference``
(rewritten after each shape: FLA's autotuning can take minutes per shape, and a time limit keeps what is done).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from benchmarks import record
from benchmarks.shapes import ATTENTION_SHAPES, by_name
from hybrid_jax.kernels.tooling.problems import Problem  # imports JAX, starts no backend

DEV, BF16 = "cuda", torch.bfloat16


def recurrent_case(s: Problem) -> tuple:
    """(call, inputs that get gradients, ``do``) for FLA's kernel of shape ``s``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from fla.ops.simple_gla import chunk_simple_gla

    torch.manual_seed(0)
    q = torch.randn(s.B, s.T, s.H, s.K, device=DEV, dtype=BF16)
    k = F.normalize(torch.randn(s.B, s.T, s.H, s.K, device=DEV), dim=-1).to(BF16)
    v = torch.randn(s.B, s.T, s.HV, s.V, device=DEV, dtype=BF16)
    g = F.logsigmoid(torch.randn(s.B, s.T, s.HV, *((s.K,) if s.per_key else ()), device=DEV)) / 16
    beta = torch.rand(s.B, s.T, s.HV, device=DEV).sigmoid().to(BF16)
    do = torch.randn(s.B, s.T, s.HV, s.V, device=DEV, dtype=BF16)
    group = s.HV // s.H

    def heads(x: torch.Tensor) -> torch.Tensor:  # value head i reads q/k head i // group
        return x.repeat_interleave(group, dim=2) if group > 1 else x

    if s.per_key:
        inputs = [q, k, v, g, beta]
        call = lambda q, k, v, g, b: chunk_kda(heads(q), heads(k), v, g, b, use_qk_l2norm_in_kernel=True)  # noqa: E731
    elif s.delta:
        inputs = [q, k, v, g, beta]
        call = lambda q, k, v, g, b: chunk_gated_delta_rule(  # noqa: E731
            heads(q), heads(k), v, g, b, use_qk_l2norm_in_kernel=True
        )
    else:
        inputs = [q, k, v, g]
        call = lambda q, k, v, g: chunk_simple_gla(heads(q), heads(k), v, g)  # noqa: E731
    inputs = [x.detach().requires_grad_() for x in inputs]
    return call, inputs, do


def attention_case(p: Problem) -> tuple:
    """(SDPA, its inputs ``[B, H, T, D]``, ``do``) at problem ``p`` (``K`` the qk head dim, ``V`` the v head dim)."""
    B, T, H, dqk, dv = p.B, p.T, p.H, p.K, p.V
    torch.manual_seed(0)
    q, k = (torch.randn(B, H, T, dqk, device=DEV, dtype=BF16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, T, dv, device=DEV, dtype=BF16, requires_grad=True)
    do = torch.randn(B, H, T, dv, device=DEV, dtype=BF16)
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [q, k, v], do


def time_case(call, inputs: list[torch.Tensor], do: torch.Tensor) -> dict[str, float]:
    def fwd():
        return call(*inputs)

    def fwd_bwd():
        out = call(*inputs)
        (out[0] if isinstance(out, tuple) else out).backward(do)

    return {
        "fwd_ms": do_bench(fwd, warmup=10, rep=50),
        "fwdbwd_ms": do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=inputs),
    }


def lift_hopper_guard() -> None:
    """Let FLA run its gated backward on Hopper under Triton < 3.7.1, which it refuses (a guard against a
    miscompile, FLA #640)."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks fla_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None,
                    help="recurrent shape names (benchmarks/shapes.py), timed in this order")
    ap.add_argument("--no-attention", action="store_true", help="skip the SDPA rows")
    ap.add_argument("--attention-only", action="store_true", help="only the SDPA rows")
    ap.add_argument("--name", default="fla_reference", help="the record's name")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = ap.parse_args(argv)
    import fla

    # These are timings only (correctness is checked against our naive recurrences), so the guard is lifted as the
    # reference's own anchor script does.
    lift_hopper_guard()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  fla {fla.__version__}", flush=True)
    cases = (
        []
        if args.attention_only
        else [(s.name, lambda s=s: recurrent_case(s)) for s in by_name(args.only)]
    )
    if not args.no_attention:
        cases += [(f"sdpa {p.name}", lambda p=p: attention_case(p)) for p in ATTENTION_SHAPES]
    results = {}
    for name, make in cases:
        try:
            results[name] = time_case(*make())
            print(
                f"{name:<28} fwd {results[name]['fwd_ms']:.3f} ms  fwd+bwd {results[name]['fwdbwd_ms']:.3f} ms",
                flush=True,
            )
        except Exception as e:  # one shape FLA cannot run must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{name:<28} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        record.save(args.name, results, out=args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
