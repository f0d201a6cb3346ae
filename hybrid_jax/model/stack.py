"""The language model: layer plan -> pre-norm residual sublayers -> final norm -> logits.

::

    h = embed(tokens)                                   [B,T,D] in the compute dtype (no positional embedding)
    for each sublayer in layer_plan(cfg):  h = h + f(norm(h))     f: MLA, GDN, KDA, Mamba2 or SwiGLU MLP
    features = final_norm(h)                            [B,T,D]
    (each add is made by the norm after it: one kernel each way on a GPU, ``RMSNorm.add``)
    logits = features @ W^T                             [B,T,V] float32; W [V,D] the embedding (tied, the default)
                                                        or lm_head (model.tie_embeddings=False)

Each sublayer sows its output (the residual stream after it) as ``output``; mixers sow their internals (see each
mixer). Capture them with ``out, intermediates = nnx.capture(model, nnx.Intermediate)(tokens)``; outside a capture
sowing is a no-op.
Decoding: ``init_cache(batch, max_len)``, ``prefill(tokens, lengths, cache)`` and ``decode_step(token, cache)`` (see
``hybrid_jax.model.cache``; ``compile_decoder`` jits them); ``context_prefill`` fills the cache from a prompt split over
a context mesh axis (``compile_context_prefill``).
``model.remat``: ``"none"``, ``"mixer"`` (all but the MLPs), ``"full"`` (every sublayer) or ``"dots"`` (every
sublayer, keeping the outputs of its matmuls without batch dimensions: the projections; the element-wise work, norms,
kernels and attention are recomputed), via ``nnx.remat``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.model.cache import Cache, MLACache, RecurrentCache
from hybrid_jax.model.gdn import GatedDeltaNet
from hybrid_jax.model.kda import KimiDeltaAttention
from hybrid_jax.model.layers import MLP, RMSNorm, dtypes, lookup, normal_init, sow
from hybrid_jax.model.mamba2 import Mamba2
from hybrid_jax.model.mla import MLA
from hybrid_jax.model.plan import REMAT_MODES, layer_plan, recomputed, sublayer_kinds
from hybrid_jax.parallel import shards

SUBLAYERS = {"mla": MLA, "gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2, "mlp": MLP}
# Attribute (and so parameter-path) name of the inner block, as Megatron names it.
BLOCK_NAMES = {"mla": "self_attention", "gdn": "mixer", "kda": "mixer", "mamba2": "mixer", "mlp": "mlp"}
# model.remat -> what a recomputed sublayer keeps besides its input (REMAT_KINDS: which sublayers recompute)
REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Sublayer(nnx.Module):
    """One pre-norm residual block ``x + f(norm(x))`` of kind ``mla|gdn|kda|mamba2|mlp`` on ``[B,T,D]`` streams.

    In the model's forward pass the stream ``x`` is formed by the next sublayer: :meth:`__call__` takes the stream
    before the previous sublayer and that sublayer's output and returns its own pair (``([B,T,D], [B,T,D])`` both
    ways), so that the add and the norm after it are one kernel each way on a GPU (:meth:`RMSNorm.add`)."""

    def __init__(self, kind: str, cfg: ConfigDict, *, rngs: nnx.Rngs):
        dtype, param_dtype = dtypes(cfg)
        self.kind, self.remat_mode = kind, cfg.get("remat", "none")
        self.remat = recomputed(kind, cfg)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                            kernel_impl=cfg.kernel_impl)
        setattr(self, BLOCK_NAMES[kind], SUBLAYERS[kind](cfg, rngs=rngs))

    @property
    def block(self) -> nnx.Module:
        return getattr(self, BLOCK_NAMES[self.kind])

    def residual(self, x: jax.Array, y: jax.Array | None, segment_ids: jax.Array | None = None,
                 context: str | None = None) -> tuple[jax.Array, jax.Array]:
        """``(s, f(norm(s)))`` with ``s = x + y``, both in ``x``'s dtype."""
        s, h = self.norm.add(x, y)
        out = self.block(h) if self.kind == "mlp" else self.block(h, segment_ids=segment_ids, context=context)
        return s, out.astype(s.dtype)

    def __call__(self, x: jax.Array, y: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 context: str | None = None) -> tuple[jax.Array, jax.Array]:
        """``(s, f(norm(s)))``: the stream ``s = x + y`` (``x`` the stream before the previous sublayer, ``y`` that
        sublayer's output; ``None`` before the first) and this sublayer's output; the stream after this sublayer is
        their sum (sown as ``output``). ``segment_ids [B,T]``: packed documents (every mixer keeps each document to
        itself). ``context``: the mesh axis the time axis is split over, inside its ``shard_map``
        (``hybrid_jax.parallel``); ``x`` is then this shard's ``[B,T_local,D]``."""
        residual = Sublayer.residual
        if self.remat:  # the stream alone crosses the recomputed function: the backward keeps s, not x and y too
            residual = nnx.remat(residual, static_argnums=4, policy=REMAT_POLICIES.get(self.remat_mode))
            x, y = (x if y is None else x + y), None
        s, out = residual(self, x, y, segment_ids, context)
        sow(self, "output", s + out)
        return s, out

    def init_cache(self, batch: int, max_len: int) -> RecurrentCache | MLACache | None:
        """The block's decoding cache (``None`` for an MLP)."""
        return None if self.kind == "mlp" else self.block.init_cache(batch, max_len)

    def extend(self, x: jax.Array, n: jax.Array, pos: jax.Array, cache: RecurrentCache | MLACache | None,
               start: jax.Array) -> tuple[jax.Array, RecurrentCache | MLACache | None]:
        """``x [B,T,D]`` continuing from ``cache`` at positions ``pos[b] + t``, first ``n[b]`` steps real, in the
        document that starts at position ``start[b]``."""
        h = self.norm(x)
        y, cache = (self.block(h), None) if self.kind == "mlp" else self.block.extend(h, n, pos, cache, start)
        return x + y.astype(x.dtype), cache

    def context_prefill(self, x: jax.Array, segment_ids: jax.Array | None, max_len: int, context: str
                        ) -> tuple[jax.Array, RecurrentCache | MLACache | None]:
        """This shard's ``x [B,T_local,D]`` (inside a ``shard_map`` over ``context``) -> ``(output, the block's cache
        after the whole sequence, the same on every shard)``."""
        h = self.norm(x)
        y, cache = ((self.block(h), None) if self.kind == "mlp"
                    else self.block.context_prefill(h, segment_ids, max_len, context))
        return x + y.astype(x.dtype), cache


def make_embedding(model_cfg: ConfigDict, rngs: nnx.Rngs) -> nnx.Embed:
    """The tied token embedding ``[V, D]`` of ``HybridLM``."""
    dtype, param_dtype = dtypes(model_cfg)
    return nnx.Embed(model_cfg.vocab_size, model_cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                     embedding_init=normal_init(model_cfg.init_std), rngs=rngs)


def make_final_norm(model_cfg: ConfigDict) -> RMSNorm:
    """The RMSNorm ``[D]`` after the last sublayer of ``HybridLM``."""
    dtype, param_dtype = dtypes(model_cfg)
    return RMSNorm(model_cfg.hidden_size, eps=model_cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                   kernel_impl=model_cfg.kernel_impl)


def make_output_head(model_cfg: ConfigDict, rngs: nnx.Rngs) -> nnx.Param:
    """The untied output matrix ``lm_head [V, D]`` (``model.tie_embeddings=False``), initialised as the embedding."""
    _, param_dtype = dtypes(model_cfg)
    shape = (model_cfg.vocab_size, model_cfg.hidden_size)
    return nnx.Param(normal_init(model_cfg.init_std)(rngs.params(), shape, param_dtype))


def tied_logits(features: jax.Array, embedding: jax.Array) -> jax.Array:
    """``features [..., D] @ embedding[V, D]^T`` in the features' dtype, accumulated and returned in float32.

    ``embedding`` is the output matrix, :attr:`HybridLM.output_embedding`: the tied embedding or the untied
    ``lm_head``."""
    return jnp.einsum("...d,vd->...v", features, embedding.astype(features.dtype),
                      preferred_element_type=jnp.float32)


class HybridLM(nnx.Module):
    """The hybrid LM of a ``config.model`` ConfigDict.

    Parameters: ``embed.embedding [V,D]`` (also the output layer unless ``model.tie_embeddings`` is False),
    ``layers[i]`` (:class:`Sublayer`, one per character of :func:`layer_plan`), ``final_norm.weight [D]``, and with
    ``model.tie_embeddings=False`` the output layer ``lm_head [V,D]``. See ``hybrid_jax.model.params`` for the name
    table.
    """

    def __init__(self, model_cfg: ConfigDict, *, rngs: nnx.Rngs):
        if model_cfg.remat not in REMAT_MODES:
            raise ValueError(f"model.remat must be one of {REMAT_MODES}, got {model_cfg.remat!r}")
        self.plan = layer_plan(model_cfg)
        self.embed = make_embedding(model_cfg, rngs)
        self.layers = nnx.List([Sublayer(kind, model_cfg, rngs=rngs) for kind in sublayer_kinds(model_cfg)])
        self.final_norm = make_final_norm(model_cfg)
        self.lm_head = None if model_cfg.tie_embeddings else make_output_head(model_cfg, rngs)
        self.kernel_impl = model_cfg.kernel_impl  # the loss's kernels too (train.step.loss)

    @property
    def embedding(self) -> jax.Array:
        """The input embedding matrix ``[V, D]`` as stored (float32 master weights)."""
        return self.embed.embedding[...]

    @property
    def output_embedding(self) -> jax.Array:
        """The output layer's matrix ``[V, D]`` as stored: the embedding when tied, else ``lm_head``."""
        return self.embedding if self.lm_head is None else self.lm_head[...]

    def features(self, tokens: jax.Array, segment_ids: jax.Array | None = None, context: str | None = None
                 ) -> jax.Array:
        """``tokens int32 [B,T]`` -> hidden states after the final norm ``[B,T,D]`` (compute dtype).

        ``segment_ids [B,T]`` int (packed documents, nondecreasing; ``None``: one sequence per row): each document
        is computed as if alone: recurrent states and short convs restart, attention stays inside it and, with
        ``model.reset_positions``, RoPE positions restart. ``context``: the mesh axis the time axis is split over,
        inside its ``shard_map`` (``hybrid_jax.train.step.context_loss``): ``tokens`` and ``segment_ids`` are then this
        shard's ``[B,T_local]`` part and so are the features; exact against the whole sequence on one device."""
        with jax.named_scope("lookup"):  # a name only: the gradient's ops carry no frame of the lookup (profiles)
            h = lookup(self.embed.embedding[...], tokens, self.embed.dtype)
        y = None
        for layer in self.layers:
            h, y = layer(h, y, segment_ids, context)
        return self.final_norm.add(h, y)[1]

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """``tokens int32 [B,T]`` -> logits ``[B,T,V]`` float32 (``tied_logits(features, output_embedding)``)."""
        return tied_logits(self.features(tokens, segment_ids), self.output_embedding)

    # ----------------------------------------------------------------------------------------- decoding
    def init_cache(self, batch: int, max_len: int) -> Cache:
        """An empty :class:`Cache` for ``batch`` sequences of up to ``max_len`` tokens (prompt + generated)."""
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  two buffers: decoding donates each
        return Cache(tuple(layer.init_cache(batch, max_len) for layer in self.layers), zeros(), zeros())

    def extend(self, tokens: jax.Array, n: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Feed ``tokens int32 [B,T]`` (row ``b``: ``n[b]`` real tokens, then right padding) after ``cache``.

        Returns the logits of each row's last real token ``[B,V]`` float32 and the cache advanced by ``n``.
        """
        h = lookup(self.embed.embedding[...], tokens, self.embed.dtype)
        layers = []
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            h, layer_cache = layer.extend(h, n, cache.lengths, layer_cache, cache.starts)
            layers.append(layer_cache)
        last = jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0]
        logits = tied_logits(self.final_norm(last), self.output_embedding)
        return logits, Cache(tuple(layers), cache.lengths + n, cache.starts)

    def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Prompts ``tokens [B,T]`` right-padded, ``lengths [B] >= 1`` -> (last-token logits ``[B,V]``, cache)."""
        return self.extend(tokens, lengths, cache)

    def decode_step(self, token: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """One token per sequence ``token int32 [B]`` -> (its logits ``[B,V]``, the cache one token longer)."""
        return self.extend(token[:, None], jnp.ones_like(cache.lengths), cache)

    def context_prefill(self, tokens: jax.Array, segment_ids: jax.Array | None, max_len: int, context: str
                        ) -> tuple[jax.Array, Cache]:
        """Prefill inside a ``shard_map`` over the mesh axis ``context``: this shard's ``tokens [B,T_local]`` (and
        ``segment_ids``) of prompts of ``S = n T_local`` real tokens -> (the last token's logits ``[B,V]`` float32, the
        cache of ``max_len`` positions after them), both the same on every shard (``compile_context_prefill``).
        The sublayers run as in :meth:`features` and return their caches: the recurrent mixers' final states (the
        last shard's) and conv tails, MLA's gathered latents. With packed documents the cache continues each row's
        last one (``Cache.starts``)."""
        h = lookup(self.embed.embedding[...], tokens, self.embed.dtype)
        layers = []
        for layer in self.layers:
            h, layer_cache = layer.context_prefill(h, segment_ids, max_len, context)
            layers.append(layer_cache)
        logits = shards.from_last_shard(tied_logits(self.final_norm(h[:, -1]), self.output_embedding), context)
        B, S = tokens.shape[0], tokens.shape[1] * shards.shard_count(context)
        starts = jnp.zeros((B,), jnp.int32)
        if segment_ids is not None:  # the first position of the last token's document
            whole = shards.gather_time(segment_ids, context)
            starts = jnp.argmax(whole == whole[:, -1:], axis=1).astype(jnp.int32)
        return logits, Cache(tuple(layers), jnp.full((B,), S, jnp.int32), starts)
