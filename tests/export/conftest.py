"""Tiny random models of each kind for the export tests (float32 compute, every parameter perturbed)."""

import jax
import jax.numpy as jnp
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
    """``HybridLM`` with random parameters drawn in numpy (fast: no per-op compiles): ``1 + N(0, 0.1)`` for norm
    weights and ``D``, ``log U(1, 16)`` for ``A_log``, ``N(0, 0.1)`` for everything else (biases included)."""
    from hybrid_jax.model import HybridLM

    rng = np.random.default_rng(seed)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg.model, rngs=nnx.Rngs(seed))), nnx.Param)

    def draw(path, x):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        if name.endswith("A_log"):
            return jnp.log(jnp.asarray(rng.uniform(1.0, 16.0, x.shape), jnp.float32))
        noise = rng.normal(0.0, 0.1, x.shape).astype(np.float32)
        return jnp.asarray(noise + 1.0 if name.endswith(("norm.weight", ".D")) else noise)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(abstract)))


def logits(model, x: np.ndarray) -> np.ndarray:
    """``model(x)`` under ``jax.jit`` (one compile beats op-by-op dispatch of the chunked kernels)."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, x))


@pytest.fixture(params=list(KINDS))
def kind(request) -> str:
    return request.param


def tokens(cfg, batch: int = 2, length: int = 37) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, length), dtype=np.int32)
