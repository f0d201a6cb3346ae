"""An lm-eval ``LM`` that runs the JAX model directly.

Scoring requests are sorted by length, cut into batches of up to ``batch_size`` rows and right-padded to a length
bucket (powers of two from 32 up to ``max_length``), so ``jax.jit`` compiles one scoring function per bucket. Right
padding never changes real positions of a causal model. The vocabulary projection, most of a small model's cost, is
computed only at the scored positions (each request's continuation): a batch holds at most
``max(L, batch_size x L / 4)`` of them, gathered into one flat ``[K]`` slot vector, and a batch closes early when its
rows' continuations would not fit. Only their log-probabilities and greedy matches ``[K]`` leave the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from hybrid_jax.data.tokenizer import Tokenizer
from hybrid_jax.model import tied_logits

MIN_BUCKET = 32
SCORED_SHARE = 4  # a batch of rows x L tokens scores at most a quarter of its positions (the continuations)


def scored_slots(batch_size: int, length: int) -> int:
    """How many positions a batch of ``batch_size`` rows of bucket ``length`` scores at most (at least one row's)."""
    return max(length, batch_size * length // SCORED_SHARE)


def bucket_length(n: int, max_length: int) -> int:
    """The smallest power of two ``>= max(n, 32)``, capped at ``max_length``."""
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), max_length)


class HybridJaxLM(TemplateLM):
    """lm-eval model over a ``HybridLM``: loglikelihood (batched, length-bucketed), loglikelihood_rolling and greedy
    generate_until (full forward per new token: no cache).

    ``model``: the module, or ``(graphdef, state)`` as ``nnx.merge`` takes them (a trainer's graphdef and live
    parameters); ``state`` may then be replaced by other values of the same shapes, reusing the compiled functions.
    ``sharding``: where the scoring batches go (e.g. split over a training mesh's data axis; ``batch_size`` a multiple
    of its shards); default: beside the parameters."""

    def __init__(self, model: nnx.Module | tuple[nnx.GraphDef, object], tokenizer: Tokenizer, *, batch_size: int = 8,
                 max_length: int = 2048, sharding: jax.sharding.Sharding | None = None):
        super().__init__()
        self.tokenizer_ = tokenizer
        self.batch_size, self.max_length, self.sharding = batch_size, max_length, sharding
        graphdef, state = model if isinstance(model, tuple) else nnx.split(model)
        self.state = state

        def score(state, inputs: jax.Array, targets: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
            """``inputs, targets [B, L]``, ``slots [K]`` (flat positions ``row * L + t``) -> (log p(target) [K]
            float32, target == argmax [K] bool) at those positions."""
            model = nnx.merge(graphdef, state)
            h = model.features(inputs)
            logits = tied_logits(h.reshape(-1, h.shape[-1])[slots], model.output_embedding)  # [K, V] float32
            wanted = targets.reshape(-1)[slots]
            picked = jnp.take_along_axis(logits, wanted[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
            return picked, jnp.argmax(logits, axis=-1) == wanted

        def next_token(state, inputs: jax.Array, last: jax.Array) -> jax.Array:
            """Greedy next token after position ``last [B]`` of ``inputs [B, L]``."""
            logits = nnx.merge(graphdef, state)(inputs)
            return jnp.argmax(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], axis=-1)

        self._score, self._next_token = jax.jit(score), jax.jit(next_token)

    # ------------------------------------------------------------------------------------------- tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and each rolling window) is conditioned on: bos if the tokenizer has one, as HFLM."""
        return self.eot_token_id if self.tokenizer_.bos_id is None else self.tokenizer_.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        bos = [self.tokenizer_.bos_id] if add_special_tokens and self.tokenizer_.bos_id is not None else []
        return bos + self.tokenizer_.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer_.decode(tokens)

    # ------------------------------------------------------------------------------------------- scoring
    def score_tokens(self, sequences: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(context tokens, continuation tokens)`` pairs -> (sum log p(continuation), continuation is greedy)."""
        windows = []
        for context, continuation in sequences:
            whole = (context + continuation)[-(self.max_length + 1):]
            windows.append((whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
        start = 0
        while start < len(order):
            L = bucket_length(len(windows[order[start]][0]), self.max_length)
            K, rows, used = scored_slots(self.batch_size, L), [], 0
            while start < len(order) and len(rows) < self.batch_size and used + windows[order[start]][2] <= K:
                rows.append(order[start])
                used += windows[order[start]][2]
                start += 1
            inputs, targets = np.zeros((self.batch_size, L), np.int32), np.zeros((self.batch_size, L), np.int32)
            slots, spans, used = np.zeros(K, np.int32), [], 0
            for r, i in enumerate(rows):
                inp, tgt, m = windows[i]
                inputs[r, : len(inp)], targets[r, : len(tgt)] = inp, tgt
                slots[used : used + m] = r * L + np.arange(len(inp) - m, len(inp))
                spans.append((used, used + m))
                used += m
            if self.sharding is not None:
                inputs, targets = jax.device_put((inputs, targets), self.sharding)
            logp, greedy = jax.device_get(self._score(self.state, inputs, targets, slots))
            for i, (a, b) in zip(rows, spans, strict=True):
                results[i] = (float(logp[a:b].sum()), bool(greedy[a:b].all()))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.score_tokens([(context, continuation) for _, context, continuation in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(logp for logp, _ in self.score_tokens(list(windows))))
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else until
            tokens = self.tok_encode(context)[-self.max_length:]
            generated: list[int] = []
            for _ in range(kwargs.get("max_gen_toks", 256)):
                window = (tokens + generated)[-self.max_length:]
                padded = np.zeros((1, bucket_length(len(window), self.max_length)), np.int32)
                padded[0, : len(window)] = window
                token = int(self._next_token(self.state, padded, np.array([len(window) - 1])).item())
                if token == self.eot_token_id:
                    break
                generated.append(token)
                text = self.tok_decode(generated)
                if any(stop in text for stop in until):
                    break
            text = self.tok_decode(generated)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
        return out
