"""Decoding: cache memory per token of context, and decode tokens/s of the cache path.

    python -m benchmarks decode --memory [--context 2048]
        cache bytes of every published config (no parameters allocated): MLA latent + rope key per token against
        the full per-head K/V an uncompressed cache would hold, and the fixed-size recurrent states (a table and
        the record ``decode_memory``)
    python -m benchmarks decode --config configs/zebra_300m_gdn.py [--batch 1,64] [--context 2048] [--steps 64]
        random-initialised model (parameters cast to the compute dtype): prefill ``context`` tokens per sequence,
        then ``steps`` jitted greedy decode steps; prints one JSON object per batch size and saves them as the
        record ``decode_<model name>``. Timed steps exclude ``--warmup`` steps (compilation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from benchmarks import configs, record
from hybrid_jax.config import load_config_file
from hybrid_jax.model import HybridLM, count_params, sublayer_kinds
from hybrid_jax.model.cache import cache_bytes, compile_decoder

CONFIGS = ("zebra_300m_gdn", "zebra_300m_gdn_hybrid", "zebra_300m_kda", "zebra_300m_mamba2_hybrid", "zebra_1b_gdn",
           "zebra_1b_kda", "zebra_1b_mamba2_hybrid", "zebra_3b", "zebra_8b")
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def cache_memory(model_cfg: ConfigDict, context: int) -> dict:
    """Bytes of the decoding cache of one sequence: per token of context and fixed, with the full-K/V comparison."""
    model = nnx.eval_shape(lambda: HybridLM(model_cfg, rngs=nnx.Rngs(0)))
    size = lambda n: cache_bytes(jax.eval_shape(lambda: model.init_cache(1, n)))  # noqa: E731
    per_token = size(2) - size(1)
    fixed = size(1) - per_token
    kinds = sublayer_kinds(model_cfg)
    m, itemsize = model_cfg.mla, jnp.dtype(model_cfg.dtype).itemsize
    full_kv = kinds.count("mla") * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * itemsize
    return dict(params_m=round(count_params(model_cfg) / 1e6, 1), mla_layers=kinds.count("mla"),
                recurrent_layers=sum(k in ("gdn", "kda", "mamba2") for k in kinds), cache_dtype=model_cfg.dtype,
                latent_bytes_per_token=per_token, full_kv_bytes_per_token=full_kv,
                recurrent_state_bytes=fixed, total_bytes_at_context=fixed + per_token * context)


def memory_table(context: int) -> dict:
    rows = {}
    print(f"| config | params | MLA / recurrent layers | MLA cache per token (latent) | full K/V per token | "
          f"recurrent state (fixed) | total per sequence at {context} |")
    print("|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        r = rows[name] = cache_memory(load_config_file(CONFIG_DIR / f"{name}.py").model, context)
        ratio = f" ({r['full_kv_bytes_per_token'] / r['latent_bytes_per_token']:.1f}x)" if r["mla_layers"] else ""
        print(f"| {name} | {r['params_m']}M | {r['mla_layers']} / {r['recurrent_layers']} | "
              f"{r['latent_bytes_per_token']:,} B | {r['full_kv_bytes_per_token']:,} B{ratio} | "
              f"{r['recurrent_state_bytes'] / 2**20:,.2f} MiB | {r['total_bytes_at_context'] / 2**20:,.1f} MiB |")
    return dict(context=context, configs=rows)


def throughput(config: ConfigDict, batch: int, context: int, steps: int, warmup: int) -> dict:
    """Prefill ``batch x context`` random tokens, then time greedy decode steps."""
    model = HybridLM(config.model, rngs=nnx.Rngs(0))
    dtype = jnp.dtype(config.model.dtype)
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, state))
    prefill, step = compile_decoder(model)
    cache = model.init_cache(batch, context + warmup + steps)
    tokens = jax.random.randint(jax.random.key(0), (batch, context), 0, config.model.vocab_size, jnp.int32)
    start = time.perf_counter()
    logits, cache = prefill(tokens, jnp.full((batch,), context, jnp.int32), cache)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    for _ in range(warmup):
        logits, cache = step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
    logits.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        logits, cache = step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
    logits.block_until_ready()
    seconds = time.perf_counter() - start
    return dict(model=config.model.name, batch=batch, context=context, device=jax.devices()[0].device_kind,
                prefill_s_incl_compile=round(prefill_s, 3), ms_per_step=round(1e3 * seconds / steps, 3),
                tokens_per_s=round(batch * steps / seconds, 1),
                cache_mib=round(cache_bytes(cache) / 2**20, 1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", action="store_true", help="the cache memory table of the published configs")
    ap.add_argument("--config", default=None, help="a config file (configs/*.py) for the throughput run; "
                    "overrides: --config.KEY=VALUE")
    ap.add_argument("--batch", default="1,64", help="comma list of batch sizes")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence (and the table's context)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args, overrides = configs.parse(ap, argv)
    if args.memory:
        record.save("decode_memory", memory_table(args.context), out=args.out)
        return
    if args.config is None:
        ap.error("give --memory or --config CONFIG")
    config = configs.load(args.config, overrides)
    results = [throughput(config, int(b), args.context, args.steps, args.warmup) for b in args.batch.split(",")]
    for r in results:
        print(json.dumps(r))
    record.save(f"decode_{config.model.name}", {"runs": results}, out=args.out)


if __name__ == "__main__":
    main()
