"""Tiny random models of each kind for the export tests (float32 compute, every parameter perturbed)."""

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import load_config

# name -> (pattern, mixer); the first two map onto FLA models
KINDS = {"gdn": ("M-M-", "gdn"), "kda": ("M-M-", "kda"), "mamba2_mla": ("*-M-", "mamba2"), "gdn_mla": ("*-G-M-", "gdn")}


def tiny_config(kind: str):
    cfg = load_config("demo")
    pattern, mixer = KINDS[kind]
    cfg.model.update(dict(pattern=pattern, mixer=mixer, num_layers=len(pattern), vocab_size=97))
    if kind == "gdn_mla":  # YaRN rope (factor > 1) in one of the MLA models
        cfg.model.mla.update(dict(rope_scaling_factor=4.0, original_max_position_embeddings=16, mscale_all_dim=0.7))
    return cfg


def perturbed_model(cfg, seed: int = 0):
    """``HybridLM`` with noise added to every parameter (so norm weights, biases and D are not trivially 1 or 0)."""
    from hybrid_jax.model import HybridLM

    model = HybridLM(cfg.model, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture(params=list(KINDS))
def kind(request) -> str:
    return request.param


def tokens(cfg, batch: int = 2, length: int = 37) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, length), dtype=np.int32)
