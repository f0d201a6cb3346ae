"""The extra work of one shard under context parallelism, timed on one GPU: each mixer's shard computation against
the plain kernel call on the shard's tokens.

    python -m benchmarks context_shard [--seq 65536] [--shards 8] [--impl auto] [--repeats 20]
    python -m benchmarks context_shard --smoke --impl xla        # tiny shapes on CPU: checks the script
    python -m benchmarks context_shard --only kda gdn --accuracy # also the error of the whole sequence in n shards

At the long-context recipe's shard (``configs/zebra_1b_kda_hybrid_64k.py``: ``--seq`` over ``--shards`` = 8192 tokens,
B = 1, bf16): KDA and MLA at that recipe's head shapes, GDN at ``zebra_1b_gdn_hybrid``'s and Mamba2's SSD (GLA) at
``zebra_1b_mamba2_hybrid``'s (``hybrid_jax.model.kernel_calls.problems_of``). Per recurrence, forward and
forward+backward (the gradients of every input) of

(a) ``plain``: the kernel as a mixer calls it without context (``use_qk_l2norm`` for the delta rule, the final state
    asked for), on ``[1, T_local]``;
(b) ``shard``: ``hybrid_jax.parallel.recurrence``'s function on the last of ``n`` shards, its collectives replaced
    by what they give on one device (:class:`OneDevice`: every gather ``n`` copies of this shard's value), so the
    prefixes run over ``n`` pairs and the backward sends gradients through every one of them.

and their ratio ``shard / plain`` (goal: <= 1.25). For MLA, the attention of shard ``i``'s queries over all ``S``
keys (the gathered latent's keys and values) as MLA splits them: the first half of its own tokens at ``q_offset =
i T_local`` and the second half of shard ``n-1-i``'s at ``(n-1-i) T_local + T_local / 2``; the slowest shard (the step
waits for it) and the mean over all shards, against causal self-attention on ``T_local`` tokens (``--impl``;
with ``auto`` also the Pallas flash kernel for both, the same kernel on each side). The gathers themselves (the pairs,
conv halos, the latent) are not timed here: docs/usage.md counts their bytes. With ``--accuracy``, per recurrence
also the whole sequence (``--seq`` tokens, the same input law) split into ``n`` real shards on this one device
(``jax.vmap`` with a named axis, so the collectives are real), its output's relative error against the float32
token-by-token recurrence, beside the plain kernel's on the whole sequence (:func:`accuracy`). Writes the record
``context_shard``.
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
from hybrid_jax.kernels.tooling.calls import as_float32, call
from hybrid_jax.kernels.tooling.errors import rel_rms
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


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """``count`` shards on one device, as the last one sees them (the step waits for it): a gather gives this shard's
    value ``count`` times (the prefixes do the same work whatever the values), the sum over shards is the value
    itself, the previous shard's tail is this one's head (its first document goes on);
    ``hybrid_jax.parallel.shards.Shards``' methods."""

    count: int

    def gather(self, x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x[None], (self.count, *x.shape))

    def index(self) -> jax.Array:
        return jnp.asarray(self.count - 1, jnp.int32)

    def total(self, x: jax.Array) -> jax.Array:
        return x

    def previous_tail(self, x: jax.Array, n: int, fill: int | float = 0) -> jax.Array:
        return x[:, :n]


def shard_fn(p: Problem, axis: str | OneDevice, impl: str):
    """``x -> o``: a shard's computation (``hybrid_jax.parallel.recurrence``) over ``axis``: a named axis, or
    :class:`OneDevice` (the last of ``n`` shards, its collectives simulated), with the kernel options a mixer passes,
    as :func:`call`."""
    function = getattr(recurrence, OPS[p.op].function)

    def fn(x: dict) -> jax.Array:
        gates = (x["g"], x["beta"]) if p.delta else (x["g"],)
        extra = dict(use_qk_l2norm=True) if p.delta else {}
        return function(x["q"], x["k"], x["v"], *gates, axis=axis, scale=p.scale, chunk_size=p.chunk or None,
                        impl=impl, **extra)[0]
    return fn


def time_recurrence(p: Problem, n: int, impl: str, repeats: int) -> dict:
    """fwd and fwd+bwd ms of the plain kernel call (:func:`call`, as a mixer makes it without context) and
    :func:`shard_fn` at ``p`` and their ratios."""
    x = inputs(p, initial_state=False)
    do = jax.random.normal(jax.random.key(1), x["v"].shape, x["v"].dtype)
    forms = {"plain": lambda x: call(p, x, impl)[0], "shard": shard_fn(p, OneDevice(n), impl)}
    res = dict(op=p.op, shape=p.shape, shards=n)
    for name, fn in forms.items():
        loss = functools.partial(lambda fn, x: jnp.sum(fn(x).astype(F32) * do.astype(F32)), fn)
        res[f"{name}_fwd_ms"] = median_ms(jax.jit(fn), x, repeats=repeats)
        res[f"{name}_fwdbwd_ms"] = median_ms(jax.jit(jax.grad(loss)), x, repeats=repeats)
    res.update(ratio_fwd=res["shard_fwd_ms"] / res["plain_fwd_ms"],
               ratio_fwdbwd=res["shard_fwdbwd_ms"] / res["plain_fwdbwd_ms"], goal=GOAL)
    res["within_goal"] = res["ratio_fwdbwd"] <= GOAL and res["ratio_fwd"] <= GOAL
    return res


def accuracy(p: Problem, n: int, impl: str) -> dict:
    """The output's relative error against the float32 token-by-token recurrence of the whole sequence (``n T``
    tokens of ``p``'s law): ``shards`` (``n`` real shards: ``jax.vmap`` over a named axis ``context``) and ``plain``
    (the kernel call on the whole sequence, as a mixer makes it without context)."""
    whole = dataclasses.replace(p, T=n * p.T)
    x = inputs(whole, initial_state=False)
    with jax.default_matmul_precision("highest"):  # float32 products, not TF32 (as calls.reference_run)
        ref = jax.jit(lambda x: call(whole, x, "naive")[0])(as_float32(x))
    plain = jax.jit(lambda x: call(whole, x, impl)[0])(x)
    split = {k: v.reshape(v.shape[0], n, p.T, *v.shape[2:]).swapaxes(0, 1) for k, v in x.items()}
    shards = jax.jit(jax.vmap(shard_fn(p, "context", impl), axis_name="context"))(split)
    shards = shards.swapaxes(0, 1).reshape(plain.shape)
    return dict(seq=n * p.T, shards_vs_f32=rel_rms(shards, ref), plain_vs_f32=rel_rms(plain, ref),
                shards_vs_plain=rel_rms(shards, plain))


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
    ap.add_argument("--accuracy", action="store_true",
                    help="also each recurrence's error on the whole sequence in --shards real shards")
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
            if args.accuracy and p.op != "attention":
                results[p.name]["accuracy"] = accuracy(p, args.shards, args.impl)
        except Exception as e:  # noqa: BLE001  one failing op must not hide the others
            results[p.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(line(p.name, results[p.name]), flush=True)
        if "accuracy" in results[p.name]:
            a = results[p.name]["accuracy"]
            print(f"  {a['seq']} tokens in {args.shards} shards: relative error {a['shards_vs_f32']:.4e} against "
                  f"the float32 recurrence (the plain kernel on the whole sequence: {a['plain_vs_f32']:.4e})",
                  flush=True)
        record.save("context_shard", dict(seq=args.seq, shards=args.shards, impl=args.impl, results=results),
                    out=args.out)


if __name__ == "__main__":
    main()
