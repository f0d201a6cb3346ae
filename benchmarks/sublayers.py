"""Time per sublayer kind against its FLOP share: does any sublayer take more time than its FLOPs justify?

    python -m benchmarks sublayers --config configs/zebra_300m_gdn_hybrid.py,configs/zebra_300m_mamba2_hybrid.py \
        --config configs/zebra_300m_kda.py [--batch 8] [--seq-len 0] [--repeats 10] [--out DIR]
    python -m benchmarks sublayers --smoke      # configs/demo.py, batch 2 x 64 tokens, on CPU

For each config (a comma list or a repeated ``--config``; default: the three 300M configs above), builds ONE
``hybrid_jax.model.Sublayer`` of each distinct kind of the layer plan (``sublayer_kinds``) in the config's compute
dtype and ``kernel_impl`` (``auto``: Pallas / cuDNN on a GPU), and times its forward and forward+backward
(``jax.vjp`` over the parameters and the input stream ``[batch, seq_len, hidden]``, to which its norm adds the
previous sublayer's output as in the model; random cotangents): median of
``--repeats`` calls after 2 warm-up calls. The "head" row is the embedding lookup + final norm + chunked
cross-entropy (``hybrid_jax.train.loss``) with the tied embedding, as in the train step.

Per kind: its count in the plan, fwd and fwd+bwd ms per instance, total ms (count x fwd+bwd), share of the summed
time; training FLOPs per token per instance (``hybrid_jax.flops``: 3 x (2 x its matrix parameters + its
``mixer_flops_per_token``); head 3 x 2 V D) and their share (the shares add up to the trainer's
``flops_per_token``, checked), achieved TFLOP/s and the fraction of the device's peak (``peak_flops``). A kind whose
time share / FLOP share exceeds 1.3 is flagged as over its share. The sum of the rows gives tokens/s and MFU of
one forward+backward without optimizer. Prints a table per config and saves the record ``sublayers``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from benchmarks import record
from hybrid_jax.config import load_config_file
from hybrid_jax.flops import flops_per_token, mixer_flops_per_token, peak_flops
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.model import Sublayer, layer_plan, sublayer_kinds
from hybrid_jax.model.stack import make_embedding, make_final_norm
from hybrid_jax.train.step.loss import cross_entropy

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIGS = ("zebra_300m_gdn_hybrid.py", "zebra_300m_mamba2_hybrid.py", "zebra_300m_kda.py")
OVER_SHARE = 1.3  # time share / FLOP share above this flags a kind


class Head(nnx.Module):
    """The model's ends as ``HybridLM`` builds them: ``embed.embedding [V,D]`` (tied) and ``final_norm [D]``."""

    def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
        self.embed = make_embedding(cfg, rngs)
        self.final_norm = make_final_norm(cfg)

    def __call__(
        self, h: jax.Array, tokens: jax.Array, targets: jax.Array, *, chunk_size: int
    ) -> tuple[jax.Array, jax.Array]:
        """``h [B,T,D]`` (last sublayer's output), ``tokens, targets int32 [B,T]`` -> (``embed(tokens) [B,T,D]``,
        float32 mean cross-entropy of ``final_norm(h) @ embedding^T`` against ``targets``)."""
        loss = cross_entropy(self.final_norm(h), self.embed.embedding[...], targets, chunk_size=chunk_size)
        return self.embed(tokens), loss


def load_config(path: str) -> ConfigDict:
    """``get_config()`` of a config file (a path, or a file name under the repository's ``configs/``)."""
    file = Path(path) if Path(path).exists() else CONFIG_DIR / path
    return load_config_file(file)


def time_module(
    module: nnx.Module, x: jax.Array, cotangent: Any, *aux: jax.Array, repeats: int, **kwargs: Any
) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms) of ``module(x, *aux, **kwargs)``; the backward pass gives the gradients of every
    parameter and of ``x`` for ``cotangent`` (same structure as the output)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def apply(p: nnx.State, x: jax.Array, *aux: jax.Array) -> Any:
        return nnx.merge(graphdef, p, rest)(x, *aux, **kwargs)

    def fwd_bwd(p: nnx.State, x: jax.Array, ct: Any, *aux: jax.Array) -> tuple[Any, Any]:
        out, vjp = jax.vjp(lambda p, x: apply(p, x, *aux), p, x)
        return out, vjp(ct)

    return (
        median_ms(jax.jit(apply), params, x, *aux, repeats=repeats),
        median_ms(jax.jit(fwd_bwd), params, x, cotangent, *aux, repeats=repeats),
    )


def matrix_params(module_fn: Callable[[], nnx.Module]) -> tuple[int, int]:
    """(all parameters, parameters in arrays with ndim >= 2) of the module ``module_fn()`` builds (no allocation)."""
    abstract = nnx.eval_shape(module_fn)
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    sizes = [(int(np.prod(leaf.shape)), len(leaf.shape)) for leaf in leaves]
    return sum(n for n, _ in sizes), sum(n for n, ndim in sizes if ndim >= 2)


def benchmark(config: ConfigDict, *, batch: int, seq_len: int, repeats: int) -> dict:
    """Time every distinct sublayer kind of ``config`` and the head at ``[batch, seq_len]``; one row per kind."""
    cfg = config.model
    kinds = sublayer_kinds(cfg)
    dtype = jnp.dtype(cfg.dtype)
    tokens = batch * seq_len
    keys = iter(jax.random.split(jax.random.key(0), 5))
    x = jax.random.normal(next(keys), (batch, seq_len, cfg.hidden_size), jnp.float32).astype(dtype)
    y = jax.random.normal(next(keys), x.shape, jnp.float32).astype(dtype)  # the previous sublayer's output
    dy = jax.random.normal(next(keys), x.shape, jnp.float32).astype(dtype)
    peak = peak_flops(jax.devices()[0])
    t_start = time.perf_counter()
    rows = {}
    for kind in dict.fromkeys(kinds):
        build = lambda kind=kind: Sublayer(kind, cfg, rngs=nnx.Rngs(0))  # remat as model.remat gives it
        params, matrix = matrix_params(build)
        fwd, fwd_bwd = time_module(build(), x, (dy, dy), y, repeats=repeats)  # the stream's add with the norm
        flops = 3.0 * (2 * matrix + mixer_flops_per_token(kind, cfg, seq_len))
        rows[kind] = dict(
            count=kinds.count(kind),
            params=params,
            matrix_params=matrix,
            fwd_ms=fwd,
            fwd_bwd_ms=fwd_bwd,
            train_flops_per_token=flops,
        )
        print(f"  {kind:7s} fwd {fwd:8.3f} ms  fwd+bwd {fwd_bwd:8.3f} ms", flush=True)
    ids = jax.random.randint(next(keys), (2, batch, seq_len), 0, cfg.vocab_size, jnp.int32)
    d_embed = jax.random.normal(next(keys), x.shape, jnp.float32).astype(dtype)
    head_fn = lambda: Head(cfg, rngs=nnx.Rngs(0))
    params, _ = matrix_params(head_fn)
    fwd, fwd_bwd = time_module(
        head_fn(),
        x,
        (d_embed, jnp.ones((), jnp.float32)),
        ids[0],
        ids[1],
        repeats=repeats,
        chunk_size=config.train.loss_chunk_size,
    )
    print(f"  {'head':7s} fwd {fwd:8.3f} ms  fwd+bwd {fwd_bwd:8.3f} ms", flush=True)
    rows["head"] = dict(
        count=1,
        params=params,
        matrix_params=params,
        fwd_ms=fwd,
        fwd_bwd_ms=fwd_bwd,
        train_flops_per_token=3.0 * 2 * cfg.vocab_size * cfg.hidden_size,
    )

    model_flops = flops_per_token(cfg, seq_len)
    summed_flops = sum(r["count"] * r["train_flops_per_token"] for r in rows.values())
    if not math.isclose(summed_flops, model_flops, rel_tol=1e-9):
        raise AssertionError(f"per-kind FLOPs add up to {summed_flops:.6g}/token, the model's are {model_flops:.6g}")
    total_ms = sum(r["count"] * r["fwd_bwd_ms"] for r in rows.values())
    for r in rows.values():
        r["total_ms"] = r["count"] * r["fwd_bwd_ms"]
        r["time_share"] = r["total_ms"] / total_ms
        r["flop_share"] = r["count"] * r["train_flops_per_token"] / model_flops
        r["time_over_flop_share"] = r["time_share"] / r["flop_share"]
        r["over_share"] = r["time_over_flop_share"] > OVER_SHARE
        r["tflops_per_s"] = r["train_flops_per_token"] * tokens / r["fwd_bwd_ms"] * 1e-9
        r["fraction_of_peak"] = r["tflops_per_s"] * 1e12 / peak if peak else None
    tokens_per_s = tokens / (total_ms * 1e-3)
    return dict(
        config=cfg.name,
        plan=layer_plan(cfg),
        kernel_impl=cfg.kernel_impl,
        dtype=cfg.dtype,
        remat=cfg.remat,
        batch=batch,
        seq_len=seq_len,
        train_flops_per_token=model_flops,
        summed_fwd_bwd_ms=total_ms,
        tokens_per_s_sum_of_parts=tokens_per_s,
        mfu_sum_of_parts=tokens_per_s * model_flops / peak if peak else None,
        wall_s=time.perf_counter() - t_start,
        kinds=rows,
    )


def print_table(result: dict, peak: float | None) -> None:
    print(
        f"\n{result['config']}: B{result['batch']} x T{result['seq_len']}, {result['dtype']}, kernel_impl "
        f"{result['kernel_impl']}, remat {result['remat']} ({result['wall_s']:.1f} s incl. compile)"
    )
    print(
        "| kind | count | params | fwd ms | fwd+bwd ms | total ms | time share | MFLOP/token (train) | FLOP share | "
        "TFLOP/s | of peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, r in result["kinds"].items():
        of_peak = f"{100 * r['fraction_of_peak']:.1f}%" if peak else "-"
        print(
            f"| {kind} | {r['count']} | {r['params'] / 1e6:.2f}M | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['total_ms']:.2f} | {100 * r['time_share']:.1f}% | {r['train_flops_per_token'] / 1e6:.1f} | "
            f"{100 * r['flop_share']:.1f}% | {r['tflops_per_s']:.1f} | {of_peak} |"
        )
    mfu = f", MFU {100 * result['mfu_sum_of_parts']:.1f}%" if peak else ""
    print(
        f"sum of parts: {result['summed_fwd_bwd_ms']:.2f} ms per fwd+bwd, "
        f"{result['tokens_per_s_sum_of_parts']:,.0f} tokens/s{mfu} (no optimizer)"
    )
    for kind, r in result["kinds"].items():
        flag = f"  OVER its share (> {OVER_SHARE})" if r["over_share"] else ""
        print(f"{kind}: time share / FLOP share = {r['time_over_flop_share']:.2f}{flag}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sublayers", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="config file(s), comma-separated or repeated (default: the three 300M configs)",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per call (0: the config's micro batch)")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: the config's seq_len)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    parser.add_argument("--smoke", action="store_true", help="configs/demo.py, batch 2 x 64 tokens, on CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    paths = [p for arg in args.config for p in arg.split(",") if p]
    paths = paths or (["demo.py"] if args.smoke else list(DEFAULT_CONFIGS))
    device = jax.devices()[0]
    peak = peak_flops(device)
    result = dict(device=device.device_kind, jax=jax.__version__, peak_flops=peak, repeats=args.repeats, configs=[])
    for path in paths:
        config = load_config(path)
        batch = 2 if args.smoke else args.batch or config.train.micro_batch_size
        seq_len = 64 if args.smoke else args.seq_len or config.train.seq_len
        print(f"{config.model.name} on {device.device_kind}", flush=True)
        result["configs"].append(benchmark(config, batch=batch, seq_len=seq_len, repeats=args.repeats))
        print_table(result["configs"][-1], peak)
    record.save("sublayers", result, out=args.out)


if __name__ == "__main__":
    main()
