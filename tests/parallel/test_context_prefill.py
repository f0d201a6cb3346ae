"""Generation continues exactly from a prompt prefilled with its time axis split over 4 devices
(``compile_context_prefill``): ``test_context_model.py``'s tiny model with every sublayer kind (MLA, GDN, KDA, Mamba2,
MLP), float32, B = 2, prompts of 32 tokens (shards of 8) of packed documents (boundaries on, just before and just
after shard edges; row 0's last document starts 2 tokens before the end, inside the short convs' 3-token tail; RoPE
positions restarting per document), then greedy decoding on one device from the cache it returns (final states, conv
tails, MLA latents and rope keys). The last prompt token's logits and every decoded step's equal one device's forward
pass over the prompt and the generated tokens, these in each row's last document (relative 1e-5), and the greedy tokens
are that pass's argmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.model import HybridLM
from hybrid_jax.model.cache import compile_context_prefill, compile_decoder
from tests.conftest import rel_err
from tests.parallel.test_context_model import T, tiny_config, tiny_params

N, STEPS = 4, 4
STARTS = ((8, 15, 17, 24, 30), (3, 7, 16, 25))  # document starts per row


def test_generation_continues_from_a_context_parallel_prefill():
    model = nnx.eval_shape(lambda: HybridLM(tiny_config().model, rngs=nnx.Rngs(0)))
    nnx.replace_by_pure_dict(params := nnx.state(model, nnx.Param), tiny_params())
    nnx.update(model, params)
    prompt = np.random.default_rng(0).integers(0, 64, (2, T), dtype=np.int32)
    seg = np.zeros((2, T + STEPS), np.int32)  # the generated tokens continue each row's last document
    for row, starts in enumerate(STARTS):
        for s in starts:
            seg[row, s:] += 1

    prefill = compile_context_prefill(model, Mesh(np.asarray(jax.devices()[:N]), ("context",)), T + STEPS)
    logits, cache = jax.device_put(prefill(jnp.asarray(prompt), jnp.asarray(seg[:, :T])), jax.devices()[0])
    np.testing.assert_array_equal(cache.starts, [30, 25])
    _, step = compile_decoder(model)
    steps, tokens = [logits], []
    for _ in range(STEPS):
        tokens.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        logits, cache = step(tokens[-1], cache)
        steps.append(logits)
    np.testing.assert_array_equal(cache.lengths, [T + STEPS] * 2)

    whole = np.concatenate([prompt, np.stack(tokens, axis=1)], axis=1)  # [2, T + STEPS]
    want = np.asarray(nnx.jit(lambda m, t, s: m(t, s))(model, jnp.asarray(whole), jnp.asarray(seg)))
    for i, got in enumerate(steps):
        assert rel_err(got, want[:, T - 1 + i]) < 1e-5, f"step {i}: {rel_err(got, want[:, T - 1 + i]):.2e}"
    np.testing.assert_array_equal(whole[:, T:], np.argmax(want[:, T - 1 : -1], axis=-1))
