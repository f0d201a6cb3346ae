"""Decoding: prefill of ragged prompts + token-by-token decode steps give the full forward pass's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.model import HybridLM
from hybrid_jax.model.cache import MLACache, RecurrentCache, cache_bytes, compile_decoder
from tests.conftest import load_config, rel_err

LENGTHS = np.array([5, 17, 1, 12])  # ragged prompts; 17 crosses the demo's 16-token chunk
STEPS = 6  # decode steps per sequence
MAX_LEN = 32


def model_of(pattern: str, impl: str = "xla") -> HybridLM:
    cfg = load_config("demo").model
    cfg.update(dict(pattern=pattern, num_layers=len(pattern), vocab_size=64, init_std=0.1, kernel_impl=impl))
    return HybridLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("pattern,impl", [("G-", "xla"), ("K-", "xla"), ("S-", "xla"), ("*-", "xla"),
                                          ("*-G-K-S-", "xla"), ("K-", "pallas_interpret")])
def test_prefill_and_decode_match_forward(pattern, impl):
    """Prefill runs the chunked kernel (``impl``: XLA, or the GPU Pallas kernel interpreted), decode the recurrence."""
    model = model_of(pattern, impl)
    B, total = len(LENGTHS), int(LENGTHS.max()) + STEPS
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (B, total), 0, 64, dtype=jnp.int32))
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))  # [B,total,V]
    rows = np.arange(B)

    prefill, step = compile_decoder(model)
    prompts = np.where(np.arange(LENGTHS.max())[None] < LENGTHS[:, None], tokens[:, : LENGTHS.max()], 0)
    logits, cache = prefill(jnp.asarray(prompts), jnp.asarray(LENGTHS, jnp.int32), model.init_cache(B, MAX_LEN))
    assert rel_err(logits, full[rows, LENGTHS - 1]) < 1e-4
    for i in range(STEPS):
        logits, cache = step(jnp.asarray(tokens[rows, LENGTHS + i]), cache)
        assert rel_err(logits, full[rows, LENGTHS + i]) < 1e-4, f"decode step {i}"
    np.testing.assert_array_equal(cache.lengths, LENGTHS + STEPS)


def test_cache_layout_and_size():
    """One entry per sublayer: recurrent state + conv tail, MLA latent + rope key per position, MLP nothing."""
    model = model_of("*-G-K-S-")
    cache = model.init_cache(3, MAX_LEN)
    kinds = [type(c) for c in cache.layers]
    assert kinds == [MLACache, type(None)] + [RecurrentCache, type(None)] * 3
    mla, gdn, kda, mamba = cache.layers[0], cache.layers[2], cache.layers[4], cache.layers[6]
    assert mla.latent.shape == (3, MAX_LEN, 16) and mla.k_rope.shape == (3, MAX_LEN, 8)
    assert gdn.state.shape == (3, 4, 16, 16) and gdn.state.dtype == jnp.float32
    assert gdn.conv.shape == (3, 3, 2 * 2 * 16 + 4 * 16)
    assert kda.state.shape == (3, 2, 16, 32)
    assert mamba.state.shape == (3, 8, 16, 16) and mamba.conv.shape == (3, 3, 128 + 2 * 2 * 16)
    per_token = (cache_bytes(model.init_cache(3, 2 * MAX_LEN)) - cache_bytes(cache)) / (3 * MAX_LEN)
    assert per_token == 4 * (16 + 8)  # float32 latent + rope key of the one MLA layer
