"""Sample from a trained run: ``python -m hybrid_jax.generate --workdir DIR --prompt "..."``.

::

    python -m hybrid_jax.generate --workdir DIR [--step N] --prompt "text" [--max-new-tokens 64]
        [--temperature 0.8 --top-p 0.95 --seed 0]            temperature 0: greedy
    python -m hybrid_jax.generate --workdir DIR --prompt-ids 1,2,3     a run without tokenizer (mock data)
    python -m hybrid_jax.generate --workdir DIR --chat                 interactive: one turn per stdin line
    python -m hybrid_jax.generate --workdir DIR --check --docs FILE.jsonl [--hf EXPORT]
        validation loss on the documents + greedy "capital of France" (a mock-data run: no --docs, mock sequences)

The prompt is encoded with the run's tokenizer (``config.data.tokenizer``) after the end-of-text id that separates
training documents. Tokens stream to stdout as they are sampled; timings go to stderr. Decoding runs the model's
cache path (``HybridLM.prefill`` / ``decode_step``, jitted once for a fixed cache of ``--cache-len`` tokens).
``--chat`` keeps the cache across turns (a base model continues the conversation's text; no chat template).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.checkpoints import load
from hybrid_jax.data.run_tokenizer import MOCK_NOTE, NoTokenizer, run_tokenizer
from hybrid_jax.data.tokenizer import Tokenizer
from hybrid_jax.model import HybridLM
from hybrid_jax.model.cache import Cache, compile_decoder
from hybrid_jax.quiet import quiet_absl

CHECK_PROMPT = "The capital of France is"


# --------------------------------------------------------------------------------------------- sampling
@partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float) -> jax.Array:
    """Next tokens ``[B]`` int32 from ``logits [B,V]``: greedy for ``temperature == 0``, else softmax(logits / T)
    restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep a sorted token while the mass before it is < top_p (so the most likely token is always kept)
        cutoff = jnp.sum(cum - jax.nn.softmax(sorted_logits, axis=-1) < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_logits, cutoff - 1, axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """Batched generation with the model's caches. ``cache_len``: the fixed cache size (prompt + new tokens)."""

    def __init__(self, model: HybridLM, cache_len: int, *, eos_id: int | None = None):
        self.model, self.cache_len, self.eos_id = model, cache_len, eos_id
        self._prefill, self._step = compile_decoder(model)

    def new_cache(self, batch: int) -> Cache:
        return self.model.init_cache(batch, self.cache_len)

    def feed(self, prompts: list[list[int]], cache: Cache) -> tuple[jax.Array, Cache]:
        """Append ``prompts`` (one non-empty list per row) to ``cache``; the logits after each row's last token.

        Rows are right-padded to a power-of-two length so that prompt lengths share compilations.
        """
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.min() < 1:
            raise ValueError("every prompt needs at least one token")
        if int(np.max(np.asarray(cache.lengths) + lengths)) > self.cache_len:
            raise ValueError(f"prompt does not fit the cache of {self.cache_len} tokens (raise --cache-len)")
        width = max(16, 1 << int(lengths.max() - 1).bit_length())
        tokens = np.zeros((len(prompts), width), np.int32)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = p
        return self._prefill(jnp.asarray(tokens), jnp.asarray(lengths), cache)

    def stream(self, logits: jax.Array, cache: Cache, max_new_tokens: int, key: jax.Array, *,
               temperature: float = 0.0, top_p: float = 1.0) -> Iterator[tuple[np.ndarray, Cache]]:
        """Yield ``(tokens [B], cache)`` per new token, sampled from ``logits`` then fed back; stops after
        ``max_new_tokens``, when every row has produced ``eos_id`` or when the cache is full. The cache yielded
        with a token does not contain it yet (feed it first to continue)."""
        done = np.zeros(logits.shape[0], bool)
        for i in range(max_new_tokens):
            key, sub = jax.random.split(key)
            token = sample(logits, sub, temperature=temperature, top_p=top_p)
            token_np = np.asarray(token)
            yield token_np, cache
            done |= token_np == self.eos_id
            if done.all() or i + 1 == max_new_tokens or int(np.max(cache.lengths)) >= self.cache_len:
                return
            logits, cache = self._step(token, cache)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, key: jax.Array, **sampling) -> list[list[int]]:
        """New tokens per prompt (each cut after its first ``eos_id``)."""
        logits, cache = self.feed(prompts, self.new_cache(len(prompts)))
        steps = [t for t, _ in self.stream(logits, cache, max_new_tokens, key, **sampling)]
        out = np.stack(steps, axis=1).tolist() if steps else [[] for _ in prompts]
        return [row[: row.index(self.eos_id) + 1] if self.eos_id in row else row for row in out]


# --------------------------------------------------------------------------------------------- text <-> ids
class Codec:
    """Prompt text/ids -> token ids and generated ids -> text, through the run's tokenizer (or ids without one)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id if self.tokenizer else None

    def encode(self, text: str | None = None, ids: str | None = None, *, start: bool = True) -> list[int]:
        """``ids`` ("1,2,3") as given, else ``text`` encoded (after the document separator eos when ``start``)."""
        if ids is not None:
            return [int(i) for i in ids.replace(",", " ").split()]
        if self.tokenizer is None:
            raise SystemExit(f"error: {MOCK_NOTE}; give the prompt as token ids, "
                             "e.g. --prompt-ids 1,2,3 (in --chat: a line of ids)")
        return ([self.tokenizer.eos_id] if start else []) + self.tokenizer.encode(text or "")

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode([i for i in ids if i != self.tokenizer.eos_id])


def print_stream(codec: Codec, tokens: Iterator[int]) -> list[int]:
    """Write each token's text to stdout as it arrives (decoding the whole tail keeps multi-byte pieces and
    SentencePiece spaces right); returns the ids."""
    ids: list[int] = []
    shown = ""
    for t in tokens:
        ids.append(t)
        text = codec.text(ids)
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else text)
        sys.stdout.flush()
        shown = text
    return ids


def timed(tokens: Iterator[tuple[np.ndarray, Cache]], stats: dict) -> Iterator[int]:
    """Row 0's token ids from :meth:`Generator.stream`, timing the decode steps (after the first token) in ``stats``."""
    start = None
    for n, (t, _) in enumerate(tokens, 1):
        if start is None:
            start = time.perf_counter()
        stats.update(tokens=n, seconds=time.perf_counter() - start)
        yield int(t[0])


def report(stats: dict, prefill_s: float, prompt_len: int) -> None:
    rate = (stats["tokens"] - 1) / stats["seconds"] if stats.get("tokens", 0) > 1 and stats["seconds"] > 0 else 0.0
    print(f"\n[prompt {prompt_len} tokens, prefill {prefill_s:.2f}s (incl. compile); {stats.get('tokens', 0)} new "
          f"tokens, {rate:.1f} tokens/s decoding]", file=sys.stderr)


# --------------------------------------------------------------------------------------------- --check
def validation_docs(config: ConfigDict, codec: Codec, path: Path | None, n: int) -> list[list[int]]:
    """``n`` documents as ids (eos first, at most ``seq_len + 1`` tokens): the jsonl file's ``text`` with the
    run's tokenizer, or mock-chain sequences (indices far from the training stream's) without one."""
    if codec.tokenizer is None:
        from hybrid_jax.data.mock import MarkovSequences

        chain = MarkovSequences(config.model.vocab_size, config.train.seq_len + 1, config.train.seed)
        return [chain(10**9 + i).tolist() for i in range(n)]
    lines = path.read_text().splitlines()[:n]
    return [codec.encode(json.loads(line)["text"])[: config.train.seq_len + 1] for line in lines]


def mean_loss(logits_fn: Callable[[np.ndarray], np.ndarray], docs: list[list[int]]) -> list[float]:
    """Next-token cross-entropy (nats) of each document under ``logits_fn(tokens [1,T]) -> [1,T,V]``."""
    losses = []
    for doc in docs:
        tokens = np.asarray(doc, np.int32)[None]
        logp = jax.nn.log_softmax(jnp.asarray(logits_fn(tokens[:, :-1]), jnp.float32), axis=-1)
        losses.append(float(-jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))))
    return losses


def hf_logits_fn(hf_dir: str, trust_remote_code: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """``tokens [1,T] -> logits [1,T,V]`` of an exported HF directory (transformers, float32, CPU), loaded by
    :func:`hybrid_jax.export.hf_load.load_export` (our exports with our code; another directory's code only with
    ``trust_remote_code``)."""
    import torch

    from hybrid_jax.export.hf_load import load_export

    model = load_export(hf_dir, trust_remote_code=trust_remote_code, note=lambda line: print(line, file=sys.stderr))

    def logits(tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()

    return logits


def greedy_full(logits_fn: Callable[[np.ndarray], np.ndarray], prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by repeated full forward passes (no cache): the reference for the cache path."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(logits_fn(np.asarray([ids], np.int32))[0, -1])))
    return ids[len(prompt):]


def check(model: HybridLM, config: ConfigDict, codec: Codec, args: argparse.Namespace) -> dict:
    """Print validation loss and the greedy continuation of :data:`CHECK_PROMPT` (JAX; the HF export too with
    ``--hf``). Returns the numbers (``loss``, ``greedy`` ids, and ``hf_loss`` / ``hf_greedy`` with ``--hf``)."""
    docs_path = Path(args.docs) if args.docs else None
    if codec.tokenizer is None:
        print("run used mock data (no tokenizer): validation = mock-chain sequences, prompt and output are token ids")
        prompt = validation_docs(config, codec, docs_path, 1)[0][:8]
    elif docs_path is None:
        raise SystemExit("--check of a run with a tokenizer needs validation documents: give --docs FILE.jsonl "
                         "(one JSON object with a 'text' field per line)")
    elif not docs_path.is_file():
        raise SystemExit(f"validation documents not found at {docs_path} (give --docs FILE.jsonl)")
    else:
        prompt = codec.encode(CHECK_PROMPT)
    docs = validation_docs(config, codec, docs_path, args.check_docs)
    forward = jax.jit(lambda tokens: model(tokens))
    result = {"loss": mean_loss(lambda t: np.asarray(forward(jnp.asarray(t))), docs)}
    gen = Generator(model, len(prompt) + args.max_new_tokens, eos_id=codec.eos_id)
    result["greedy"] = gen.generate([prompt], args.max_new_tokens, jax.random.key(0))[0]
    print(f"validation loss over {len(docs)} documents: {np.mean(result['loss']):.4f} "
          f"(per document: {', '.join(f'{x:.3f}' for x in result['loss'])})")
    print(f"greedy: {codec.text(prompt)!r} -> {codec.text(result['greedy'])!r}")
    if args.hf:
        hf = hf_logits_fn(args.hf, args.trust_remote_code)
        result["hf_loss"] = mean_loss(hf, docs)
        result["hf_greedy"] = greedy_full(hf, prompt, len(result["greedy"]))
        same = "same" if result["hf_greedy"] == result["greedy"] else "DIFFERENT"
        print(f"HF export {args.hf}: validation loss {np.mean(result['hf_loss']):.4f}; greedy "
              f"{codec.text(result['hf_greedy'])!r} ({same} tokens as the JAX model)")
    return result


# --------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid_jax.generate", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--prompt", default=None, help="prompt text (needs the run's tokenizer)")
    p.add_argument("--prompt-ids", default=None, help="prompt as token ids, e.g. 1,2,3 (runs without tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-len", type=int, default=None, help="cache size (default: run seq_len + max-new-tokens)")
    p.add_argument("--chat", action="store_true", help="interactive: each stdin line is a turn")
    p.add_argument("--check", action="store_true", help="validation loss + greedy continuation of a fixed prompt")
    p.add_argument("--hf", default=None, help="with --check: an exported HF directory to check as well")
    p.add_argument("--trust-remote-code", action="store_true", help="with --hf: run the directory's own modeling "
                   "code (our exports load with this package's code without it)")
    p.add_argument("--docs", default=None, help="with --check: validation documents (jsonl with 'text'); needed "
                   "unless the run used mock data")
    p.add_argument("--check-docs", type=int, default=4, help="with --check: number of validation documents")
    args = p.parse_args(argv)
    if not (args.check or args.chat) and args.prompt is None and args.prompt_ids is None:
        p.error("give --prompt, --prompt-ids, --chat or --check")
    return args


def chat(gen: Generator, codec: Codec, args: argparse.Namespace, key: jax.Array) -> None:
    """One turn per stdin line, continuing one cache (started over when full)."""
    state = {"cache": gen.new_cache(1), "pending": []}  # pending: the last sampled token, not yet in the cache
    print("[chat: one line per turn; ctrl-D ends]", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            continue

        def encode(start: bool, line: str = line) -> list[int]:  # the first turn of a context starts a document
            return codec.encode(ids=line) if codec.tokenizer is None else codec.encode(line, start=start)

        turn = encode(not state["pending"])
        if int(state["cache"].lengths[0]) + len(state["pending"]) + len(turn) + args.max_new_tokens > gen.cache_len:
            print("[context full: starting over]", file=sys.stderr)
            state, turn = {"cache": gen.new_cache(1), "pending": []}, encode(True)
        key, sub = jax.random.split(key)
        logits, cache = gen.feed([state["pending"] + turn], state["cache"])

        def tokens(logits=logits, cache=cache, sub=sub) -> Iterator[int]:
            for token, state["cache"] in gen.stream(logits, cache, args.max_new_tokens, sub,
                                                    temperature=args.temperature, top_p=args.top_p):
                state["pending"] = [int(token[0])]
                yield int(token[0])

        print_stream(codec, tokens())
        print(flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_absl()
    model, config = load(args.workdir, args.step)
    try:
        codec = Codec(run_tokenizer(config))
    except NoTokenizer as e:
        raise SystemExit(f"error: {e}") from None
    if args.check:
        check(model, config, codec, args)
        return
    cache_len = args.cache_len or config.train.seq_len + args.max_new_tokens
    gen = Generator(model, cache_len, eos_id=codec.eos_id)
    key = jax.random.key(args.seed)
    if args.chat:
        chat(gen, codec, args, key)
        return
    prompt = codec.encode(args.prompt, args.prompt_ids)
    start = time.perf_counter()
    logits, cache = gen.feed([prompt], gen.new_cache(1))
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    stats: dict = {}
    print_stream(codec, timed(gen.stream(logits, cache, args.max_new_tokens, key, temperature=args.temperature,
                                         top_p=args.top_p), stats))
    print()
    report(stats, prefill_s, len(prompt))


if __name__ == "__main__":
    main()
