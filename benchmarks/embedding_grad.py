"""The token embedding's gradient on uniform mock ids and on real text's ids, two ways: the scatter-add that a
gather's transpose becomes, and ``hybrid_jax.model.layers.lookup``'s (sorted per row, float32 sums).

    python -m benchmarks embedding_grad --data DATA_DIR [--batch 32] [--seq-len 2048] [--hidden 1024] [--vocab 32000]

``DATA_DIR`` is a prepared dataset (``python -m hybrid_jax.prepare``, or Megatron ``.bin/.idx`` with ``--source
megatron``): its first ``batch x seq_len`` tokens are the real ids. Real text repeats a few ids thousands of times
per batch, and atomic adds on one row serialise: the reason a step on prepared data was slower than on mock data.
Writes the record ``embedding_grad``: ms of each form on each kind of ids, the most frequent id's share, and the
largest difference between the two forms' gradients (the gather's transpose sums in bfloat16).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import record
from hybrid_jax.data.source import TokenWindows, open_source
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.model.layers import lookup


def gradients() -> dict:
    """``{form: jitted (table [V, D] float32, ids [B, T], cotangent [B, T, D] bfloat16) -> d table [V, D]}``."""

    def through(embed):
        def grad(table, ids, cotangent):
            return jax.vjp(lambda t: embed(t, ids), table)[1](cotangent)[0]
        return jax.jit(grad)

    return {"gather_transpose": through(lambda t, ids: jnp.take(t.astype(jnp.bfloat16), ids, axis=0)),
            "lookup": through(lambda t, ids: lookup(t, ids, jnp.bfloat16))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks embedding_grad", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a prepared dataset: its first batch x seq-len tokens")
    ap.add_argument("--source", default="tokens", choices=("tokens", "megatron"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = ap.parse_args(argv)
    n = args.batch * args.seq_len
    windows = TokenWindows(open_source(args.data, args.source), args.seq_len, args.vocab)
    if len(windows) < args.batch:
        ap.error(f"--data {args.data}: needs {args.batch} windows of {args.seq_len} tokens, has {len(windows)}")
    real = np.concatenate([windows[i] for i in range(args.batch)])
    rng = np.random.default_rng(0)
    ids = {"mock": rng.integers(0, args.vocab, n, dtype=np.int32), "data": real}
    table = jnp.asarray(rng.standard_normal((args.vocab, args.hidden)) * 0.02, jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((args.batch, args.seq_len, args.hidden)), jnp.bfloat16)
    forms = gradients()
    figures: dict = dict(batch=args.batch, seq_len=args.seq_len, hidden=args.hidden, vocab=args.vocab)
    for kind, flat in ids.items():
        x = jnp.asarray(flat.reshape(args.batch, args.seq_len))
        row = {form: median_ms(fn, table, x, cotangent, repeats=args.repeats) for form, fn in forms.items()}
        row["top_id_share"] = float(np.bincount(flat).max() / n)
        row["max_abs_difference"] = float(jnp.abs(forms["lookup"](table, x, cotangent)
                                                  - forms["gather_transpose"](table, x, cotangent)).max())
        figures[kind] = row
        print(kind, row, flush=True)
    record.save("embedding_grad", figures, out=args.out)


if __name__ == "__main__":
    main()
