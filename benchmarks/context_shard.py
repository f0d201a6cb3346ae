"""The extra work of one shard under context parallelism, timed on one GPU: each mixer's shard computation against
the plain kernel call on the shard's tokens.

    python -m benchmarks context_shard [--seq 65536] [--shards 8] [--impl auto] [--repeats 20]
    python -m benchmarks context_shard --smoke --impl xla        # tiny shapes on CPU: checks the script

At the long-context recipe's shard (``configs/zebra_1b_kda_hybrid_64k.py``: ``--seq`` over ``--shards`` = 8192 tokens,
B = 1, bf16): KDA and MLA at that recipe's head shapes, GDN at ``zebra_1b_gdn_hybrid``'s and Mamba2's SSD (GLA) at
``zebra_1b_mamba2_hybrid``'s (``hybrid_jax.model.kernel_calls.problems_of``). Per recurrence, forward and
forward+backward (the gradients of every input) of

(a) ``plain``: the kernel as a mixer calls it without context (``use_qk_l2norm`` for the delta rule, the final state
    asked for), on ``[1, T_local]``;
(b) ``shard``: ``hybrid_jax.parallel.recurrence``'s steps on one shard, the collectives replaced by what they produce:
    the pair (the delta rule: the widened kernel call on ``[v | 0]`` from ``[0 | I]``; GLA: ``S_local`` in closed
    form), the prefix (``shard_prefix``) over the ``n`` gathered ``(M, S_local)`` pairs with this shard's pair last
    (the other ``n - 1`` are inputs, differentiated too, as the all-gather's transpose does), and the outputs (the
    delta rule: the completion product; GLA: the kernel from the start state). The backward also receives a
    cotangent for this shard's own pair (what the reduce-scatter of the others' gradients delivers).

and their ratio ``shard / plain`` (goal: <= 1.25). For MLA, the attention of shard ``i``'s queries over all ``S``
keys (the gathered latent's keys and values) as MLA splits them: the first half of its own tokens at ``q_offset =
i T_local`` and the second half of shard ``n-1-i``'s at ``(n-1-i) T_local + T_local / 2``; the slowest shard (the step
waits for it) and the mean over all shards, against causal self-attention on ``T_local`` tokens (``--impl``;
with ``auto`` also the Pallas flash kernel for both, the same kernel on each side). The gathers themselves (the pairs,
conv halos, the latent) are not timed here: docs/usage.md counts their bytes. Writes the record ``context_shard``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp

from benchmarks import record
from benchmarks.configs import CONFIG_DIR, load
from hybrid_jax import kernels
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tooling.calls import call
from hybrid_jax.kernels.tooling.inputs import inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.model.kernel_calls import problems_of
from hybrid_jax.parallel import recurrence

GOAL = 1.25  # shard / plain time, per recurrence
F32 = jnp.float32
# (config, the kernel ops taken from it): KDA and MLA from the long-context recipe, GDN and GLA from their 1B recipes
SOURCES = (("zebra_1b_kda_hybrid_64k", ("kda", "attention")), ("zebra_1b_gdn_hybrid", ("gdn",)),
           ("zebra_1b_mamba2_hybrid", ("gla",)))


def problems(seq: int, shards: int, smoke: bool = False) -> list[Problem]:
    """The kernel calls of one shard of ``seq`` tokens over ``shards``, B = 1; ``smoke``: one head (and one value
    head per key head) of dims 16."""
    out = []
    for name, ops in SOURCES:
        cfg = load(CONFIG_DIR / f"{name}.py")
        for p in problems_of(cfg, batch=1, seq_len=seq // shards, max_heads=None):
            if p.op not in ops:
                continue
            p = dataclasses.replace(p, T=seq // shards, name=f"{p.op} ({name})")
            if smoke:
                p = dataclasses.replace(p, H=1, HV=1 if p.op == "attention" else 2, K=16, V=16)
            out.append(p)
    return out


def shard_fn(p: Problem, impl: str):
    """``(x, others) -> (o, this shard's (M, S_local))``: the last of ``n`` shards' computation, its all-gather
    simulated by stacking ``others`` (the ``n - 1`` other shards' ``M [n-1,B,HV,K,K]`` (GLA: ``[n-1,B,HV]``) and
    ``S_local [n-1,B,HV,K,V]``) with its own pair; the kernel options a mixer passes, as :func:`call`."""
    chunk = p.chunk or None

    def fn(x: dict, others: dict) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        if p.delta:
            o_local, q_through, m, local = recurrence.widened_delta_rule(
                getattr(kernels, OPS[p.op].function), x["q"], x["k"], x["v"], x["g"], x["beta"], scale=p.scale,
                use_qk_l2norm=True, chunk_size=chunk, impl=impl, segment_ids=None)
        else:
            m, local = recurrence.local_simple_gla(x["k"], x["v"], x["g"])
        pairs = (jnp.concatenate([others["m"], m[None].astype(F32)]), jnp.concatenate([others["s"], local[None]]))
        n = pairs[0].shape[0]
        keeps = jnp.ones((n, p.B), bool)
        start, _ = recurrence.shard_prefix(*pairs, keeps, None, n - 1)
        if p.delta:
            o = recurrence.complete_delta_rule(o_local, q_through, start)
        else:
            o = kernels.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], scale=p.scale, initial_state=start,
                                         chunk_size=chunk, impl=impl)[0]
        return o, (m, local)
    return fn


def _others(p: Problem, n: int, key: jax.Array) -> dict:
    """The other ``n - 1`` shards' pairs (random, of the right sizes)."""
    km, ks = jax.random.split(key)
    m_shape = (n - 1, p.B, p.HV, p.K, p.K) if p.delta else (n - 1, p.B, p.HV)
    m = 0.1 * jax.random.normal(km, m_shape, F32) if p.delta else jax.random.uniform(km, m_shape, F32)
    return dict(m=m, s=jax.random.normal(ks, (n - 1, p.B, p.HV, p.K, p.V), F32))


def time_recurrence(p: Problem, n: int, impl: str, repeats: int) -> dict:
    """fwd and fwd+bwd ms of the plain kernel call (:func:`call`, as a mixer makes it without context) and
    :func:`shard_fn` at ``p`` and their ratios."""
    x = inputs(p, initial_state=False)
    keys = jax.random.split(jax.random.key(1), 3)
    do = jax.random.normal(keys[0], x["v"].shape, x["v"].dtype)
    others = _others(p, n, keys[1])
    own = shard_fn(p, impl)
    d_pair = jax.tree.map(lambda a: jax.random.normal(keys[2], a.shape, a.dtype),
                          jax.eval_shape(lambda: own(x, others)[1]))
    def plain(x: dict) -> jax.Array:
        return call(p, x, impl)[0]

    def plain_loss(x):
        return jnp.sum(plain(x).astype(F32) * do.astype(F32))

    def shard_loss(x, others):  # the pair's cotangent: what the reduce-scatter of the other shards' gradients brings
        o, pair = own(x, others)
        return jnp.sum(o.astype(F32) * do.astype(F32)) + sum(jnp.sum(a * b) for a, b in zip(pair, d_pair,
                                                                                             strict=True))

    plain_fwd, shard_fwd = jax.jit(plain), jax.jit(lambda x, o: own(x, o)[0])
    plain_fb, shard_fb = jax.jit(jax.grad(plain_loss)), jax.jit(jax.grad(shard_loss, argnums=(0, 1)))
    res = dict(op=p.op, shape=p.shape, shards=n, plain_fwd_ms=median_ms(plain_fwd, x, repeats=repeats),
               plain_fwdbwd_ms=median_ms(plain_fb, x, repeats=repeats),
               shard_fwd_ms=median_ms(shard_fwd, x, others, repeats=repeats),
               shard_fwdbwd_ms=median_ms(shard_fb, x, others, repeats=repeats))
    res.update(ratio_fwd=res["shard_fwd_ms"] / res["plain_fwd_ms"],
               ratio_fwdbwd=res["shard_fwdbwd_ms"] / res["plain_fwdbwd_ms"], goal=GOAL)
    res["within_goal"] = res["ratio_fwdbwd"] <= GOAL and res["ratio_fwd"] <= GOAL
    return res


def time_attention(p: Problem, n: int, impl: str, repeats: int) -> dict:
    """fwd and fwd+bwd ms of causal self-attention on ``T_local`` tokens and of a shard's queries over all ``n
    T_local`` keys at each offset (the last shard's and the mean), under ``impl`` (and, with ``auto`` on a GPU, the
    Pallas flash kernel too)."""
    T, S = p.T, n * p.T
    whole = dataclasses.replace(p, T=S)
    kv = inputs(whole)
    q = kv["q"][:, :T]
    do = jax.random.normal(jax.random.key(2), (p.B, T, p.H, p.V), q.dtype)

    def timings(kind: str) -> dict:
        attend = functools.partial(kernels.attention, causal=True, scale=p.scale, impl=kind)
        half = T // 2

        def balanced(q, k, v, offset):  # MLA's split: its first half at `offset`, its mirror's second half
            return jnp.concatenate([attend(q[:, :half], k, v, q_offset=offset[0]),
                                    attend(q[:, half:], k, v, q_offset=offset[1])], axis=1)

        fwd = jax.jit(balanced)
        fb = jax.jit(jax.grad(lambda q, k, v, offset: jnp.sum(balanced(q, k, v, offset).astype(F32)
                                                               * do.astype(F32)), argnums=(0, 1, 2)))
        self_fwd = jax.jit(attend)
        self_fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(F32) * do.astype(F32)),
                                   argnums=(0, 1, 2)))
        local = (q, kv["k"][:, :T], kv["v"][:, :T])
        out = dict(plain_fwd_ms=median_ms(self_fwd, *local, repeats=repeats),
                   plain_fwdbwd_ms=median_ms(self_fb, *local, repeats=repeats))
        offsets = [jnp.asarray([i * T, (n - 1 - i) * T + half], jnp.int32) for i in range(n)]
        per_shard = [(median_ms(fwd, q, kv["k"], kv["v"], o, repeats=repeats),
                      median_ms(fb, q, kv["k"], kv["v"], o, repeats=repeats)) for o in offsets]
        out.update(shard_fwd_ms=[f for f, _ in per_shard], shard_fwdbwd_ms=[b for _, b in per_shard])
        for what in ("fwd", "fwdbwd"):
            times = out[f"shard_{what}_ms"]
            out[f"ratio_max_{what}"] = max(times) / out[f"plain_{what}_ms"]
            out[f"ratio_mean_{what}"] = statistics.mean(times) / out[f"plain_{what}_ms"]
        return out

    res = dict(op=p.op, shape=p.shape, keys=S, shards=n, impl=impl, **timings(impl))
    if impl == "auto" and jax.devices()[0].platform == "gpu":
        res["pallas"] = timings("pallas")
    return res


def line(name: str, r: dict) -> str:
    """One result as a log line."""
    if "error" in r:
        return f"{name}: FAILED {r['error'][:300]}"
    if r["op"] == "attention":
        text = (f"{name} {r['shape']} over {r['keys']} keys: plain fwd {r['plain_fwd_ms']:.3f} / fwd+bwd "
                f"{r['plain_fwdbwd_ms']:.3f} ms; slowest shard {max(r['shard_fwd_ms']):.3f} / "
                f"{max(r['shard_fwdbwd_ms']):.3f}"
                f" ms ({r['ratio_max_fwd']:.2f}x / {r['ratio_max_fwdbwd']:.2f}x), mean shard "
                f"{r['ratio_mean_fwd']:.2f}x / {r['ratio_mean_fwdbwd']:.2f}x")
        if "pallas" in r:
            f = r["pallas"]
            text += (f"; flash both sides: slowest {f['ratio_max_fwd']:.2f}x / {f['ratio_max_fwdbwd']:.2f}x, mean "
                     f"{f['ratio_mean_fwd']:.2f}x / {f['ratio_mean_fwdbwd']:.2f}x")
        return text
    return (f"{name} {r['shape']}: plain fwd {r['plain_fwd_ms']:.3f} / fwd+bwd {r['plain_fwdbwd_ms']:.3f} ms; shard "
            f"{r['shard_fwd_ms']:.3f} / {r['shard_fwdbwd_ms']:.3f} ms; ratio {r['ratio_fwd']:.2f}x / "
            f"{r['ratio_fwdbwd']:.2f}x (goal <= {GOAL}: {'met' if r['within_goal'] else 'NOT met'})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks context_shard", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=65536, help="the whole sequence's tokens")
    ap.add_argument("--shards", type=int, default=8, help="the context axis' size")
    ap.add_argument("--impl", default="auto", help="kernel impl: auto | pallas | pallas_interpret | xla")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=None, help="ops to run (gdn, kda, gla, attention)")
    ap.add_argument("--smoke", action="store_true", help="one head of dims 16 per op (checks the script on CPU)")
    ap.add_argument("--out", default=None, help="where the record goes (default $OUT)")
    args = ap.parse_args(argv)
    if args.seq % args.shards:
        ap.error(f"--shards {args.shards} does not divide --seq {args.seq}")
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  impl {args.impl}  shard "
          f"{args.seq // args.shards} of {args.seq} tokens", flush=True)
    results = {}
    for p in problems(args.seq, args.shards, args.smoke):
        if args.only and p.op not in args.only:
            continue
        timer = time_attention if p.op == "attention" else time_recurrence
        try:
            results[p.name] = timer(p, args.shards, args.impl, args.repeats)
        except Exception as e:  # noqa: BLE001  one failing op must not hide the others
            results[p.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(line(p.name, results[p.name]), flush=True)
        record.save("context_shard", dict(seq=args.seq, shards=args.shards, impl=args.impl, results=results),
                    out=args.out)


if __name__ == "__main__":
    main()
