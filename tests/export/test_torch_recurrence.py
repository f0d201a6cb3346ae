"""The exported model's chunked recurrence (``modeling_hybrid.chunked_recurrence``) against its token loop
(``modeling_hybrid.recurrence``) and against the JAX chunked form (``kernels/reference.py``): values and gradients."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from hybrid_jax.export.modeling_hybrid import chunked_recurrence, recurrence  # noqa: E402
from hybrid_jax.kernels import reference  # noqa: E402

# (T, chunk): one token, T < chunk, ragged T, several chunks exactly
LENGTHS = [(1, 16), (5, 16), (37, 16), (64, 16)]
GATES = ["scalar", "per_key"]


def inputs(T: int, gate: str, delta: bool, *, B: int = 2, H: int = 3, K: int = 8, V: int = 6, g_min: float = -1.0,
           seed: int = 0) -> dict[str, torch.Tensor]:
    """float64 ``q, k`` (l2-normalised k, as the mixers feed it), ``v``, log decay ``g`` in ``[g_min, -0.01]``
    (``[B,T,H]`` or ``[B,T,H,K]``), ``beta`` in ``(0, 1)`` or ``None``."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, T, H, K))
    x = dict(q=rng.normal(size=(B, T, H, K)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
             v=rng.normal(size=(B, T, H, V)),
             g=rng.uniform(g_min, -0.01, size=(B, T, H, K) if gate == "per_key" else (B, T, H)),
             beta=rng.uniform(0.05, 0.95, size=(B, T, H)) if delta else None)
    return {name: None if a is None else torch.tensor(a, dtype=torch.float64) for name, a in x.items()}


def value_and_grads(fn, x: dict, dtype: torch.dtype, cotangent: torch.Tensor, **kw) -> list[torch.Tensor]:
    """``[o, d<cotangent . o>/dq, /dk, /dv, /dg, (/dbeta)]`` in float64, the inputs cast to ``dtype`` first."""
    leaves = {n: a.to(dtype).requires_grad_() for n, a in x.items() if a is not None}
    o = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves.get("beta"), 0.5, **kw)
    grads = torch.autograd.grad((o.double() * cotangent).sum(), list(leaves.values()))
    return [t.detach().double() for t in (o, *grads)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (0 when both are 0: e.g. dg at T = 1, where the decay meets the zero state)."""
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny))


@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
def test_chunked_matches_token_loop(T, chunk, gate, delta):
    x = inputs(T, gate, delta)
    cot = torch.tensor(np.random.default_rng(1).normal(size=x["v"].shape))
    want = value_and_grads(recurrence, x, torch.float64, cot)
    exact = value_and_grads(chunked_recurrence, x, torch.float64, cot, chunk_size=chunk)
    single = value_and_grads(chunked_recurrence, x, torch.float32, cot, chunk_size=chunk)
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    for name, w, e, s in zip(names, want, exact, single, strict=False):
        assert rel(e, w) <= 1e-12, name  # float64: the same function, up to rounding
        assert rel(s, w) <= 1e-5, name  # float32 compute
    assert single[0].abs().max() > 0.1  # not trivially small


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
def test_strong_decay_stays_finite(gate, delta):
    """Gates down to -20 per step (cumulative -1280 over a chunk of 64): no overflow, NaN or inf anywhere."""
    x = inputs(150, gate, delta, g_min=-20.0)
    cot = torch.tensor(np.random.default_rng(1).normal(size=x["v"].shape))
    want = value_and_grads(recurrence, x, torch.float64, cot)
    got = value_and_grads(chunked_recurrence, x, torch.float32, cot, chunk_size=64)
    for w, s in zip(want, got, strict=True):
        assert torch.isfinite(s).all()
        assert rel(s, w) <= 1e-5


def test_dtype_and_shape():
    x = inputs(37, "scalar", True)
    o = chunked_recurrence(*(x[n].to(torch.bfloat16) for n in ("q", "k", "v", "g", "beta")), 0.5, chunk_size=16)
    assert o.shape == x["v"].shape and o.dtype == torch.bfloat16


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
def test_matches_jax_chunked(gate, delta):
    """Same inputs (float32) through ``kernels/reference.py::chunked_recurrence``: values to 1e-5."""
    x = inputs(37, gate, delta)
    x32 = {n: None if a is None else a.float() for n, a in x.items()}
    ours = chunked_recurrence(x32["q"], x32["k"], x32["v"], x32["g"], x32["beta"], 0.5, chunk_size=16).numpy()
    args = [None if x32[n] is None else jnp.asarray(x32[n].numpy()) for n in ("q", "k", "v", "g", "beta")]
    theirs = np.asarray(reference.chunked_recurrence(*args, scale=0.5, chunk_size=16)[0])
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= 1e-5
