"""Capture what every sublayer of a model computes for one sequence (see :mod:`hybrid_jax.explore`)."""


from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax import kernels
from hybrid_jax.checkpoints import load
from hybrid_jax.config import load_config_file
from hybrid_jax.data.mock import SUCCESSOR_PROBS, MarkovSequences
from hybrid_jax.data.run_tokenizer import run_tokenizer
from hybrid_jax.data.tokenizer import Tokenizer
from hybrid_jax.kernels.reference import l2_normalize
from hybrid_jax.model import HybridLM
from hybrid_jax.model.layers import lookup
from hybrid_jax.model.plan import MIXERS
from hybrid_jax.model.stack import BLOCK_NAMES

RECURRENT = MIXERS  # ("gdn", "kda", "mamba2")


# --------------------------------------------------------------------------------------------- loading
def resolve_workdir(workdir: str | Path) -> Path:
    """``workdir`` as given if absolute or found from here; a relative one is also looked up from the directory the
    notebook server was started in (``$PWD``, which a Jupyter kernel inherits while its own working directory is the
    notebook's folder) and from the repository root; FileNotFoundError naming every place tried."""
    path = Path(workdir).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        roots = [Path.cwd(), Path(os.environ.get("PWD", Path.cwd())), Path(__file__).resolve().parents[1]]
        candidates = list(dict.fromkeys(root / path for root in roots))
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"workdir {workdir} not found; tried {', '.join(map(str, candidates))}: give an absolute "
                            "path or one relative to where you started Jupyter")


def load_model(workdir: str | Path | None = None, config: str | Path | ConfigDict | None = None,
               seed: int = 0) -> tuple[HybridLM, ConfigDict]:
    """The checkpoint in ``workdir`` (newest step, via ``hybrid_jax.load``; a relative path as
    :func:`resolve_workdir` finds it), else a random init of ``config``."""
    if workdir:
        return load(resolve_workdir(workdir))
    if config is None:
        raise ValueError("load_model needs a workdir (a trained run) or a config (file path or ConfigDict)")
    config = config if isinstance(config, ConfigDict) else load_config_file(config)
    return nnx.jit(lambda: HybridLM(config.model, rngs=nnx.Rngs(seed)))(), config  # jit: one compile, not many


def tokenizer_of(config: ConfigDict) -> Tokenizer | None:
    """The run's tokenizer (``data.tokenizer``, else its prepared data's manifest's), or None for mock data."""
    return run_tokenizer(config)


def prompt_tokens(config: ConfigDict, text: str | None = None, length: int = 64, index: int = 0) -> np.ndarray:
    """``[T]`` int32: ``text`` encoded with the run's tokenizer, or mock-chain sequence ``index`` of ``length``
    tokens (the demo's training distribution) when the run has no tokenizer or no text is given."""
    tokenizer = tokenizer_of(config)
    if tokenizer is not None and text:
        ids = tokenizer.encode(text)
        return np.asarray(([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids, np.int32)
    return MarkovSequences(config.model.vocab_size, length, config.train.seed)(index)


# --------------------------------------------------------------------------------------------- capture
@dataclass
class Trace:
    """Everything one forward pass of one sequence computed (numpy, batch dimension dropped).

    ``tokens [T]``; ``logits [T,V]``; ``residual[0]`` is the embedding and ``residual[i + 1]`` the stream after
    sublayer ``i``, ``updates[i]`` sublayer ``i``'s ``f(norm(x))`` (``[T,D]`` each); ``internals[i]`` holds the
    block's sown values and its submodules' outputs (nested dict as ``nnx.capture`` names them, e.g.
    ``["conv1d"]["__call__"]``, the short conv's output pieces ``[T,h,d]``); ``attention[i]``: ``[H,T,T]`` for each
    MLA sublayer ``i``; ``mixers[i]`` the block module itself (for its head sizes and ``A_log``).
    """

    tokens: np.ndarray
    plan: str
    kinds: list[str]
    logits: np.ndarray
    residual: list[np.ndarray]
    updates: list[np.ndarray]
    internals: list[dict]
    attention: dict[int, np.ndarray] = field(default_factory=dict)
    mixers: list[nnx.Module] = field(default_factory=list, repr=False)
    labels: list[str] = field(default_factory=list)  # [T] each token as text (or ``id N`` without a tokenizer)


def token_labels(tokens: np.ndarray, config: ConfigDict | None) -> list[str]:
    """``[T]`` labels for plot axes: each token decoded with the run's tokenizer, else its id."""
    tokenizer = tokenizer_of(config) if config is not None else None
    if tokenizer is None:
        return [str(int(t)) for t in tokens]
    return [repr(tokenizer.decode([int(t)]))[1:-1] for t in tokens]


@contextlib.contextmanager
def attention_capture(model: HybridLM) -> Iterator[None]:
    """Make every MLA sublayer sow its attention map ``[B,H,T,T]`` for the duration of the block."""
    blocks = [layer.block for layer in model.layers if layer.kind == "mla"]
    for block in blocks:
        block.capture_attention = True
    try:
        yield
    finally:
        for block in blocks:
            block.capture_attention = False


def run(model: HybridLM, tokens: np.ndarray, config: ConfigDict | None = None) -> Trace:
    """Run ``tokens [T]`` through ``model`` and capture every sown value and every submodule's output; ``config``
    (the run's) labels the tokens with its tokenizer on the plots."""
    with attention_capture(model):
        logits, state = _capture(model, jnp.asarray(tokens, jnp.int32)[None])
    # each sown value is a 1-tuple of a [1, ...] array: keep the array, drop the batch dimension
    values = jax.tree.map(_first_row, nnx.to_pure_dict(state), is_leaf=lambda x: isinstance(x, tuple))
    layers = [values["layers"][i] for i in range(len(model.layers))]
    embedded = lookup(model.embedding, jnp.asarray(tokens, jnp.int32), model.embed.dtype)  # the model's own lookup
    residual = [np.asarray(embedded, np.float32)] + [layer["output"] for layer in layers]
    internals, updates, attention = [], [], {}
    for i, (layer, captured) in enumerate(zip(model.layers, layers, strict=True)):
        name = BLOCK_NAMES[layer.kind]
        internals.append(captured[name])
        updates.append(captured[name]["__call__"])
        if layer.kind == "mla":
            attention[i] = captured[name]["attention"]
    return Trace(tokens=np.asarray(tokens), plan=model.plan, kinds=[layer.kind for layer in model.layers],
                 logits=np.asarray(logits[0], np.float32), residual=residual, updates=updates, internals=internals,
                 attention=attention, mixers=[layer.block for layer in model.layers],
                 labels=token_labels(np.asarray(tokens), config))


def _first_row(sown: tuple) -> np.ndarray | list[np.ndarray]:
    """A sown value, a 1-tuple of a ``[1, ...]`` array or of a list of them (a short conv's output pieces), as float32
    without the batch dimension."""
    value = sown[0]
    if isinstance(value, (list, tuple)):
        return [np.asarray(v[0], np.float32) for v in value]
    return np.asarray(value[0], np.float32)


@nnx.jit
def _capture(model: HybridLM, tokens: jax.Array) -> tuple[jax.Array, nnx.State]:
    return nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(tokens)


def rms(x: np.ndarray) -> np.ndarray:
    """Root mean square over the last axis."""
    return np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1))


def activation_norms(trace: Trace) -> dict[str, np.ndarray]:
    """``residual [L+1]``: RMS of the stream (embedding, then after each sublayer); ``update [L]``: RMS of each
    sublayer's ``f(norm(x))``. Both averaged over positions."""
    return dict(residual=np.array([rms(r).mean() for r in trace.residual]),
                update=np.array([rms(u).mean() for u in trace.updates]))


# --------------------------------------------------------------------------------------------- recurrent layers
@dataclass
class RecurrentLayer:
    """One GDN / KDA / Mamba2 sublayer's dynamics over the sequence. ``HV``: value (SSM) heads."""

    index: int
    kind: str
    states: np.ndarray  # [T,HV,K,V] float32
    log_decay: np.ndarray  # [T,HV] or [T,HV,K] (KDA): g
    beta: np.ndarray | None  # [T,HV] (GDN, KDA)
    dt: np.ndarray | None  # [T,HV] (Mamba2)
    labels: list[str] = field(default_factory=list)  # [T] the tokens, for plot axes

    @property
    def state_norm(self) -> np.ndarray:
        """``||S_t||_F`` per head, ``[T,HV]``."""
        return np.sqrt(np.sum(np.square(self.states, dtype=np.float64), axis=(-2, -1)))

    @property
    def memory(self) -> np.ndarray:
        """Effective memory in tokens per head, ``[T,HV]`` (KDA: mean over key channels)."""
        m = effective_memory(self.log_decay)
        return m.mean(-1) if m.ndim == 3 else m

    @property
    def decay(self) -> np.ndarray:
        """Per-token decay ``exp(g)`` per head, ``[T,HV]`` (KDA: mean over key channels)."""
        a = np.exp(self.log_decay)
        return a.mean(-1) if a.ndim == 3 else a


def effective_memory(g: np.ndarray) -> np.ndarray:
    """``m_t = exp(g_t) m_{t-1} + 1`` with ``m_0 = 0`` along axis 0: tokens the decay lets through. Same shape as g."""
    a = np.exp(np.asarray(g, np.float64))
    m = np.empty_like(a)
    previous = np.zeros_like(a[0])
    for t in range(len(a)):
        previous = m[t] = a[t] * previous + 1.0
    return m


def state_trajectory(recurrence, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array | None) -> np.ndarray:
    """``S_t`` at every step, ``[T,HV,K,V]``, of a recurrence from ``hybrid_jax.kernels`` (no q/k l2 norm: pass k
    already normalised). ``k: [T,H,K]``, ``v: [T,HV,V]``, ``g: [T,HV(,K)]``, ``beta: [T,HV]`` or None.

    ``o_t = S_t^T q_t`` with scale 1, so the probe ``q = e_i`` reads row ``i`` of ``S_t``; the ``K`` probes run as
    one batch of ``K`` copies of the sequence.
    """
    T, H, K = k.shape
    probes = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32)[:, None, None, :], (K, T, H, K))
    copies = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (K, *x.shape))
    extra = () if beta is None else (copies(beta),)
    o = _probe(recurrence, probes, copies(k), copies(v), copies(g), *extra)
    return np.asarray(jnp.transpose(o, (1, 2, 0, 3)))  # [K,T,HV,V] -> [T,HV,K,V]


@functools.partial(jax.jit, static_argnums=0)
def _probe(recurrence, *args: jax.Array) -> jax.Array:
    return recurrence(*args, scale=1.0, impl="xla")[0]


def recurrent_layer(trace: Trace, index: int) -> RecurrentLayer:
    """The state trajectory, gates and betas of recurrent sublayer ``index`` of ``trace``."""
    kind, mixer, inner = trace.kinds[index], trace.mixers[index], trace.internals[index]
    conv = [jnp.asarray(p) for p in inner["conv1d"]["__call__"]]  # [T,h,d] each: silu(conv(.)) of q|k|v or x|B|C
    if kind in ("gdn", "kda"):
        _, k, v = conv
        recurrence = kernels.chunk_gated_delta_rule if kind == "gdn" else kernels.chunk_kda
        g, beta = inner["g"], inner["beta"]
        states = state_trajectory(recurrence, l2_normalize(k), v, g, beta)
        return RecurrentLayer(index, kind, states, g, beta, None, trace.labels)
    if kind == "mamba2":
        x, b, _ = conv
        dt = inner["dt"]
        g = dt * -np.exp(np.asarray(mixer.A_log[...], np.float32))
        states = state_trajectory(kernels.chunk_simple_gla, b, dt[..., None] * x, g, None)
        return RecurrentLayer(index, kind, states, g, None, dt, trace.labels)
    raise ValueError(f"sublayer {index} is {kind!r}, not a recurrent mixer {RECURRENT}")


def recurrent_states(trace: Trace) -> list[RecurrentLayer]:
    """:func:`recurrent_layer` for every GDN / KDA / Mamba2 sublayer, in depth order."""
    return [recurrent_layer(trace, i) for i, kind in enumerate(trace.kinds) if kind in RECURRENT]


# --------------------------------------------------------------------------------------------- predictions
def next_token_probs(trace: Trace) -> np.ndarray:
    """Softmax of the logits, ``[T,V]``: row ``t`` is the distribution of the token after position ``t``."""
    return np.asarray(jax.nn.softmax(jnp.asarray(trace.logits), axis=-1))


def target_probs(trace: Trace) -> np.ndarray:
    """``[T-1]``: the probability the model gave to the token that actually came next."""
    probs = next_token_probs(trace)
    return probs[np.arange(len(trace.tokens) - 1), trace.tokens[1:]]


def next_token_table(trace: Trace, config: ConfigDict, k: int = 8, position: int = -1) -> list[tuple[str, float]]:
    """The ``k`` most likely next tokens after ``position`` as ``(label, probability)``, most likely first.

    Labels are decoded text with the run's tokenizer, else ``id N`` (plus ``*`` for a true successor in the mock
    chain, whose probabilities are ``hybrid_jax.data.mock.SUCCESSOR_PROBS``).
    """
    probs = next_token_probs(trace)[position]
    top = np.argsort(probs)[::-1][:k]
    tokenizer = tokenizer_of(config)
    if tokenizer is not None:
        return [(repr(tokenizer.decode([int(i)])), float(probs[i])) for i in top]
    successors = set(MarkovSequences(config.model.vocab_size, 2, config.train.seed).successors[
        trace.tokens[position]].tolist())
    return [(f"id {i}{' *' if i in successors else ''}", float(probs[i])) for i in top]


def chain_probs(tokens: np.ndarray, config: ConfigDict) -> np.ndarray:
    """``[T-1]``: the mock chain's own probability of each transition ``tokens[t] -> tokens[t+1]``."""
    successors = MarkovSequences(config.model.vocab_size, 2, config.train.seed).successors[tokens[:-1]]
    hit = successors == tokens[1:, None]
    return np.where(hit.any(-1), np.asarray(SUCCESSOR_PROBS)[hit.argmax(-1)], 0.0)
