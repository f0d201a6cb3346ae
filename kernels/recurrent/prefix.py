"""Chains of affine state maps ``S -> M S + S_local`` over consecutive parts of a sequence (a context axis' shards,
or a shard's groups of chunks), and their transposes for the gradient, in ``log2 n`` levels of small batched
products (Hillis-Steele scans) rather than ``n`` products one after the other: each level is one product per head
over all parts, so the chains cost a few launches whatever ``n``.

A part's map is ``M [..., K, K]`` (``S_out = M @ S_in``; or a scalar per head ``[...]``) and ``S_local [..., K, V]``,
float32, parts stacked on axis 0. ``keeps [n, B]`` bool (or None: always): part ``i``'s first token continues part
``i - 1``'s document, else part ``i`` starts from 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def carry(m: jax.Array, state: jax.Array, transpose: bool = False) -> jax.Array:
    """``M state`` (``M^T state`` with ``transpose``) for ``state [..., K, X]``: ``M [..., K, K]`` or a scalar per
    head ``[...]`` (the same leading dims), float32 in and out. The products run at the backend's default precision
    (TF32 on NVIDIA tensor cores, full float32 on CPU): the kernels carry the same states through bfloat16 products,
    so these are not what limits the accuracy."""
    if m.ndim == state.ndim - 2:
        return m[..., None, None] * state
    return jnp.einsum("...ji,...jv->...iv" if transpose else "...ij,...jv->...iv", m, state,
                      precision=jax.lax.Precision.DEFAULT)


def scan(transitions: jax.Array, locals_: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inclusive scan along axis 0: part ``i``'s ``(M, S_local)`` becomes that of parts ``0 .. i`` in turn (two maps
    ``a`` then ``b`` make ``(M_b M_a, M_b S_a + S_b)``), in ``ceil(log2 n)`` levels."""
    scalar = transitions.ndim == locals_.ndim - 2
    step = 1
    while step < transitions.shape[0]:
        later, earlier = transitions[step:], transitions[:-step]
        if scalar:
            m, s = later * earlier, carry(later, locals_[:-step])
        else:  # one product for both: M_b [M_a | S_a]
            both = carry(later, jnp.concatenate([earlier, locals_[:-step]], axis=-1))
            m, s = both[..., : earlier.shape[-1]], both[..., earlier.shape[-1]:]
        transitions = jnp.concatenate([transitions[:step], m])
        locals_ = jnp.concatenate([locals_[:step], s + locals_[step:]])
        step *= 2
    return transitions, locals_


def apply(transitions: jax.Array, state: jax.Array) -> jax.Array:
    """Every part's ``M`` applied to one ``state [..., K, V]`` -> ``[n, ..., K, V]``."""
    return carry(transitions, jnp.broadcast_to(state, (transitions.shape[0], *state.shape)))


def _where_kept(x: jax.Array, keeps: jax.Array | None) -> jax.Array:
    """``x [n, B, ...]`` with part ``i``'s rows zeroed where ``keeps[i]`` is false (part 0's always kept: it starts
    from the given state)."""
    if keeps is None:
        return x
    kept = keeps.at[0].set(True)
    return jnp.where(kept.reshape(kept.shape + (1,) * (x.ndim - 2)), x, 0.0)


def starts(chains: tuple[jax.Array, jax.Array], start: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(every part's start state [n, ...], the last part's end state)`` from :func:`scan`'s ``chains`` and part 0's
    ``start`` (None: zeros)."""
    chain_m, chain_s = chains
    if start is None:
        start, ends_ = jnp.zeros_like(chain_s[0]), chain_s
    else:
        start = start.astype(F32)
        ends_ = apply(chain_m, start) + chain_s
    return jnp.concatenate([start[None], ends_[:-1]]), ends_[-1]


def shard_prefix(transitions: jax.Array, locals_: jax.Array, keeps: jax.Array | None,
                 initial_state: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The exclusive prefix of ``S -> M_i S + S_local(i)`` over ``n`` parts in order, from ``initial_state``
    (``[B, HV, K, V]``, part 0's start; None: zeros): ``transitions [n, B, HV, K, K]`` (or ``[n, B, HV]``),
    ``locals_ [n, B, HV, K, V]``, ``keeps [n, B]`` or None. Returns ``(every part's start state [n, B, HV, K, V], the
    last one's final state [B, HV, K, V])``, float32."""
    chains = scan(_where_kept(transitions.astype(F32), keeps), locals_.astype(F32))
    start_states, final = starts(chains, initial_state)
    return _where_kept(start_states, keeps), final


def suffix(transitions: jax.Array, own: jax.Array, keeps: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The transposed chain, open at its end: ``(A, C)``, both ``[n, ...]``, such that part ``i``'s end-state
    gradient is ``A_i d_final + C_i`` (:func:`ends`), where part ``i - 1``'s is ``keep(i) (own(i) + M_i^T d_end(i))``
    and the last part's is ``d_final``. ``own [n, B, HV, K, V]``: each part's gradient of its start state from its
    own outputs; the rest as :func:`shard_prefix`'s."""
    scalar = transitions.ndim == own.ndim - 2
    transposed = transitions.astype(F32) if scalar else jnp.swapaxes(transitions.astype(F32), -1, -2)
    # part i's map d -> keep(i) (M_i^T d + own(i)), for i = n-1 down to 1, composed in that order
    a, c = scan(_where_kept(transposed, keeps)[1:][::-1], _where_kept(own.astype(F32), keeps)[1:][::-1])
    shape = transposed.shape[1:]
    identity = jnp.ones(shape, F32) if scalar else jnp.broadcast_to(jnp.eye(shape[-1], dtype=F32), shape)
    return jnp.concatenate([a[::-1], identity[None]]), jnp.concatenate([c[::-1], jnp.zeros_like(own[:1], F32)])


def ends(a: jax.Array, c: jax.Array, d_final: jax.Array) -> jax.Array:
    """Every part's end-state gradient ``[n, B, HV, K, V]`` from :func:`suffix`'s ``(A, C)`` and ``d_final``."""
    return apply(a, d_final.astype(F32)) + c


def reverse_prefix(transitions: jax.Array, own: jax.Array, keeps: jax.Array | None, d_final: jax.Array
                   ) -> jax.Array:
    """The gradient of each part's end state ``[n, B, HV, K, V]``, the transpose of :func:`shard_prefix`'s chain:
    the last part's is ``d_final``; part ``i - 1``'s is ``keep(i) (own(i) + M_i^T d_end(i))``."""
    return ends(*suffix(transitions, own, keeps), d_final)
