"""Ground truth for the kernel library: naive token-by-token recurrences (this file's ``naive_*``).

Everything here is pure JAX, float32 inside, and written for clarity rather than speed. The chunked
forms and the Pallas kernels are tested against these functions.

Shapes follow FLA: ``[batch, time, heads, dim]``. ``q, k: [B,T,H,K]``; ``v: [B,T,HV,V]`` with ``HV`` a
multiple of ``H`` (value head ``i`` reads q/k head ``i // (HV // H)``); states are ``[B,HV,K,V]`` float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in float32 (FLA's ``l2norm``)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def expand_heads(x: jax.Array, num_value_heads: int) -> jax.Array:
    """Repeat q/k heads ``[B,T,H,K] -> [B,T,HV,K]`` so consecutive value heads share one q/k head."""
    return jnp.repeat(x, num_value_heads // x.shape[2], axis=2)


def naive_recurrence(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array | None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    use_qk_l2norm: bool = False,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One recurrence for the whole family, one token at a time.

    Args:
      q, k: ``[B,T,H,K]``.  v: ``[B,T,HV,V]``.
      g: log decay, ``[B,T,HV]`` (scalar per head: GDN, GLA/SSD) or ``[B,T,HV,K]`` (per key channel: KDA).
      beta: ``[B,T,HV]`` turns the delta rule on; ``None`` gives plain gated linear attention.
      initial_state: ``[B,HV,K,V]`` or ``None`` (zeros).
      segment_ids: ``[B,T]`` int, nondecreasing document index (packed documents), or ``None`` (one sequence). The
        state restarts from zero at the first token of each document after the first; the first keeps
        ``initial_state``, and the final state is the last document's.

    Per value head, with ``D_t = diag(exp(g_t))`` (or the scalar ``exp(g_t)``)::

        delta rule:  S_t = D_t S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T
        no delta:    S_t = D_t S_{t-1} + k_t v_t^T
        o_t = scale * S_t^T q_t

    Returns ``(o [B,T,HV,V] in v's dtype, final_state [B,HV,K,V] float32)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    qf = expand_heads(q.astype(jnp.float32), HV) * scale
    kf = expand_heads(k.astype(jnp.float32), HV)
    vf = v.astype(jnp.float32)
    gf = g.astype(jnp.float32)
    per_key_gate = gf.ndim == 4
    bf = None if beta is None else beta.astype(jnp.float32)
    s0 = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    starts = None if segment_ids is None else document_starts(segment_ids)  # [B,T] bool

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t, start_t = xs
        if start_t is not None:
            state = jnp.where(start_t[:, None, None, None], 0.0, state)
        decay = jnp.exp(g_t)[..., :, None] if per_key_gate else jnp.exp(g_t)[..., None, None]
        state = state * decay
        if b_t is None:
            state = state + k_t[..., :, None] * v_t[..., None, :]
        else:
            err = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, state)
            state = state + (b_t[..., None] * k_t)[..., :, None] * err[..., None, :]
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

    xs = tuple(None if x is None else jnp.moveaxis(x, 1, 0) for x in (qf, kf, vf, gf, bf, starts))
    final, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), final


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """``[B,T]`` bool: the first token of every document but the window's first (``segment_ids`` changes)."""
    seg = segment_ids.astype(jnp.int32)
    return jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)


def naive_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, scale: float | None = None,
    segment_ids: jax.Array | None = None, q_offset: int | jax.Array | None = None,
) -> jax.Array:
    """Plain softmax attention in float32. ``q: [B,Tq,H,Dqk]``, ``k: [B,Tk,H,Dqk]``, ``v: [B,Tk,H,Dv]`` ->
    ``[B,Tq,H,Dv]``.

    The queries are the tokens at positions ``q_offset .. q_offset + Tq - 1`` of the keys' sequence (an int or a
    traced int scalar; ``None``: ``Tk - Tq``, the last ``Tq``, so 0 for self-attention): the causal mask compares
    those positions with the keys'. ``segment_ids [B,Tk]``: the keys' sequence's packed documents (the queries' are its
    rows from ``q_offset``); a query sees only the keys of its own document."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T, S = q.shape[1], k.shape[1]
    offset = S - T if q_offset is None else q_offset
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        mask = jnp.arange(T)[:, None] + offset >= jnp.arange(S)[None, :]
        s = jnp.where(mask, s, -jnp.inf)
    if segment_ids is not None:
        q_ids = segment_ids if T == S else jax.lax.dynamic_slice_in_dim(segment_ids, offset, T, axis=1)
        same = q_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B,1,Tq,Tk]
        s = jnp.where(same, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(v.dtype)


def chunk_segments(segment_ids: jax.Array, chunk_size: int) -> jax.Array:
    """``segment_ids [B,T]`` -> ``[B,Tp]`` int32 (``Tp``: T rounded up to a multiple of ``chunk_size``): each row's
    document counted from the one the chunk carries in (the document of the previous chunk's last row; for the
    first chunk, the window's first document). 0: the row continues the carried state; ``r > 0``: the row is in
    the chunk's ``r``-th new document. Padding rows join the last document. Within a chunk two rows are in one
    document exactly when their values are equal, and the chunk ends in the carried document when its last value
    is 0."""
    B, T = segment_ids.shape
    C = chunk_size
    N = -(-T // C)
    seg = segment_ids.astype(jnp.int32)
    seg = jnp.pad(seg, ((0, 0), (0, N * C - T)), mode="edge").reshape(B, N, C)
    carried = jnp.concatenate([seg[:, :1, 0], seg[:, :-1, -1]], axis=1)  # [B,N]
    return (seg - carried[:, :, None]).reshape(B, N * C)


def _decayed_scores(a: jax.Array, b: jax.Array, gamma: jax.Array, *, strict: bool,
                    same_doc: jax.Array | None = None) -> jax.Array:
    """``S_ij = sum_d a_id b_jd exp(gamma_id - gamma_jd)`` for ``j < i`` (``j <= i`` unless strict), else 0.

    ``a, b: [..., C, K]``; ``gamma: [..., C]`` (scalar gate) or ``[..., C, K]`` (per-key gate), the
    chunk-local cumulative log decay. The exponent is masked *before* ``exp`` so the upper triangle can
    never overflow (``0 * inf`` is how NaNs get in). ``same_doc [..., C, C]``: pairs in two documents are 0 too.
    """
    C = a.shape[-2]
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    mask = (i > j) if strict else (i >= j)
    if same_doc is not None:
        mask = mask & same_doc
    if gamma.ndim == a.ndim - 1:  # scalar gate: decay outside the matmul
        diff = gamma[..., :, None] - gamma[..., None, :]
        decay = jnp.exp(jnp.where(mask, diff, -jnp.inf))
        return jnp.einsum("...id,...jd->...ij", a, b) * decay
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]  # [..., C, C, K]
    decay = jnp.exp(jnp.where(mask[..., None], diff, -jnp.inf))
    return jnp.einsum("...id,...jd,...ijd->...ij", a, b, decay)


def chunked_recurrence(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array | None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The same function as :func:`naive_recurrence`, computed chunk by chunk (WY/UT form) in pure JAX.

    Within a chunk of ``C`` tokens with chunk-local cumulative log decay ``gamma`` and start state ``S0``::

        A     = strict_lower(beta_i * sum_d k_id k_jd exp(gamma_id - gamma_jd))      (delta rule only)
        u     = (I + A)^-1 (beta * V);   w = (I + A)^-1 (beta * exp(gamma) * K)
        v_new = u - w S0                  (plain GLA: v_new = V)
        o     = scale * [(Q * exp(gamma)) S0 + lower_incl(Q K^T decayed) v_new]
        S1    = exp(gamma_last) S0 + (K * exp(gamma_last - gamma))^T v_new

    Everything that does not depend on ``S0`` is computed for all chunks at once; only the three
    state products run in the ``lax.scan`` over chunks. T need not be a multiple of ``chunk_size``: the
    tail is padded with ``k = v = beta = 0`` and ``g = 0``, which leaves the state untouched.

    ``segment_ids [B,T]`` (packed documents, :func:`chunk_segments`): the Gram products ``A`` and the output's
    ``Q K^T`` keep only pairs in one document (so ``(I + A)`` is block diagonal per document and its inverse
    exact); the ``S0`` terms (``Q exp(gamma) S0``, ``w S0``) only rows of the carried document; the update sums
    only rows of the chunk's last document, and decays ``S0`` only if that document is the carried one. The
    gate's cumsums are unchanged: every exponent used is a difference within one document. Masks go on the
    exponents, before ``exp``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    qf = expand_heads(q.astype(jnp.float32), HV) * scale
    kf = expand_heads(k.astype(jnp.float32), HV)
    vf = v.astype(jnp.float32)
    gf = g.astype(jnp.float32)
    per_key_gate = gf.ndim == 4

    def to_chunks(x):  # [B,T,HV,...] -> [N,B,HV,C,...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    qc, kc, vc, gc = map(to_chunks, (qf, kf, vf, gf))
    gamma = jnp.cumsum(gc, axis=3)  # [N,B,HV,C] or [N,B,HV,C,K]
    g_last = gamma[:, :, :, -1]  # [N,B,HV] or [N,B,HV,K]
    same_doc, carried, in_last = None, True, True
    if segment_ids is not None:
        rel = jnp.moveaxis(chunk_segments(segment_ids, C).reshape(B, N, C), 1, 0)[:, :, None]  # [N,B,1,C]
        same_doc = rel[..., :, None] == rel[..., None, :]  # [N,B,1,C,C]
        carried, in_last = rel == 0, rel == rel[..., -1:]  # [N,B,1,C]
        if per_key_gate:
            carried, in_last = carried[..., None], in_last[..., None]
    masked = lambda keep, x: x if keep is True else jnp.where(keep, x, -jnp.inf)  # noqa: E731
    last_carried = carried if carried is True else carried[:, :, :, -1]  # [N,B,1] or [N,B,1,1]
    if per_key_gate:
        q_decayed = qc * jnp.exp(masked(carried, gamma))
        k_to_end = kc * jnp.exp(masked(in_last, g_last[:, :, :, None, :] - gamma))
        state_decay = jnp.exp(masked(last_carried, g_last))[..., :, None]  # [N,B,HV,K,1]
    else:
        q_decayed = qc * jnp.exp(masked(carried, gamma))[..., None]
        k_to_end = kc * jnp.exp(masked(in_last, g_last[..., None] - gamma))[..., None]
        state_decay = jnp.exp(masked(last_carried, g_last))[..., None, None]
    scores = _decayed_scores(qc, kc, gamma, strict=False, same_doc=same_doc)  # [N,B,HV,C,C]

    if beta is None:
        u, w = vc, None
    else:
        bc = to_chunks(beta.astype(jnp.float32))[..., None]  # [N,B,HV,C,1]
        a = bc * _decayed_scores(kc, kc, gamma, strict=True, same_doc=same_doc)
        eye = jnp.eye(C, dtype=jnp.float32)
        # (I + A) is unit lower triangular: its inverse times a right-hand side is one triangular solve.
        solve = lambda rhs: jax.scipy.linalg.solve_triangular(
            eye + a, rhs, lower=True, unit_diagonal=True
        )
        decay = jnp.exp(masked(carried, gamma))
        k_decayed = kc * (decay if per_key_gate else decay[..., None])
        u, w = solve(bc * vc), solve(bc * k_decayed)

    s0 = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(state, xs):
        u_c, w_c, qd_c, sc_c, ke_c, sd_c = xs
        v_new = u_c if w_c is None else u_c - w_c @ state
        o_c = qd_c @ state + sc_c @ v_new
        state = sd_c * state + jnp.swapaxes(ke_c, -1, -2) @ v_new
        return state, o_c

    final, o = jax.lax.scan(step, s0, (u, w, q_decayed, scores, k_to_end, state_decay))
    o = jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 1).reshape(B, N * C, HV, V)[:, :T]
    return o.astype(v.dtype), final
