"""In-kernel gradient math of one chunk: through the output and state update, and through the WY transform.

The WY backward needs neither u nor w: with ``v_new = u - w h``, ``dA = -(T^T dv_new) v_new^T`` and
``T^T dw = -(T^T dv_new) h^T``, so the forward keeps ``w`` (for the reverse state pass) and ``v_new``, not ``u``.
Lists are row blocks (see ``block_math``); every gradient is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybrid_jax.kernels.recurrent import block_math as bm
from hybrid_jax.kernels.recurrent import segments as segs
from hybrid_jax.kernels.recurrent.block_math import F32


def gram_vjp(m: list, a: list, b: list, gamma: list, strict: bool, span: float = 0.0):
    """Gradients of ``G = block_math.block_gram(a, b, gamma, strict)`` for ``dG = m`` (lower block-triangular):
    ``(da, db, dgamma)`` lists of float32 blocks (``dgamma`` in the gate's shape); ``span``: see
    :func:`block_math.one_matmul_pairs`."""
    if gamma[0].ndim == 2:
        da = bm.block_decay_matmul(m, b, gamma, strict, transpose=False, span=span)
        db = bm.block_decay_matmul(m, a, gamma, strict, transpose=True, span=span)
        return da, db, [x.astype(F32) * dx - y.astype(F32) * dy for x, dx, y, dy in zip(a, da, b, db, strict=True)]
    m, (a,), (b,), (gamma,) = m[0][0], a, b, gamma  # a scalar gate: the chunk is one block
    cd = a.dtype
    dm = m * bm.masked_exp(gamma[:, None] - gamma[None, :], bm.tri(a.shape[0], strict))
    z = dm * bm.dot(a, b.T)  # dG * G
    return [bm.dot(dm.astype(cd), b)], [bm.dot(dm.T.astype(cd), a)], [jnp.sum(z, axis=1) - jnp.sum(z, axis=0)]


class Snapshots:
    """One chunk's state snapshots ``h`` (its start state) and ``dh`` (the gradient of its end state), ``[K, V]``
    refs, in the products the gradient kernels take of them; each tile is loaded where it is first used (loads up
    front take more registers: benchmarks/NOTES.md, "KDA: from 6.5x to 1.3x our GDN"). ``hdh_ref``: ``sum_v h dh``
    ``[K]`` from the reverse state pass, if it computed it (``RecurrentConfig.hdh_in_state_bwd``)."""

    def __init__(self, h_ref, dh_ref=None, hdh_ref=None):
        self.refs, self.tiles, self.hdh_ref = {"h": h_ref, "dh": dh_ref}, {}, hdh_ref

    def _tile(self, name: str) -> jax.Array:
        if name not in self.tiles:
            self.tiles[name] = self.refs[name][...]
        return self.tiles[name]

    def times_h(self, x: jax.Array) -> jax.Array:
        """``x h^T`` (float32 ``[S, K]``) for ``x [S, V]``."""
        return bm.dot(x, self._tile("h").T)

    def times_dh(self, x: jax.Array) -> jax.Array:
        """``x dh^T`` (float32 ``[S, K]``) for ``x [S, V]``."""
        return bm.dot(x, self._tile("dh").T)

    def hdh(self) -> jax.Array:
        """``sum_v h dh`` (float32 ``[K]``; single-axis reductions only, for the Triton lowering)."""
        if self.hdh_ref is not None:
            return self.hdh_ref[...]
        return jnp.sum(self._tile("h").astype(F32) * self._tile("dh").astype(F32), axis=1)


def grad_through_output(q: list, k: list, gamma: list, snap: Snapshots, v_new: list, do: list, scale: float,
                        span: float, docs: segs.Documents | None = None):
    """One chunk's gradients through the output and the state update: ``(dq, dk, d(gamma))`` float32 blocks, the
    last row's d(gamma) including the chunk-end decay term. Without the delta rule this is the whole gradient.
    ``span``: see :func:`block_math.one_matmul_pairs`; ``docs``: the chunk's documents (``segments``) or None."""
    # The order of the operations is the one the Triton compiler was tuned with (see forward._wy_kernel).
    qf, kf = [x.astype(F32) for x in q], [x.astype(F32) for x in k]
    per_key = gamma[0].ndim == 2
    gamma_last = bm.row(gamma[-1], -1)

    # o = (scale Q exp(gamma)) h + P v_new,  P = scale gram(Q, K) (inclusive lower)
    dq = [snap.times_h(x) * scale * segs.carried(bm.per_column(jnp.exp(g)), docs, i)
          for i, (x, g) in enumerate(zip(do, gamma, strict=True))]
    dgamma = [bm.to_gate_shape(dx * x, per_key) for dx, x in zip(dq, qf, strict=True)]
    dp = segs.pairs([[bm.dot(do[i], v_new[j].T) * scale for j in range(i + 1)] for i in range(len(do))], docs)
    dq_p, dk, dgamma_p = gram_vjp(dp, q, k, gamma, strict=False, span=span)
    dq = [x + y for x, y in zip(dq, dq_p, strict=True)]
    dgamma = [x + y for x, y in zip(dgamma, dgamma_p, strict=True)]

    # h' = exp(gamma_last) h + (K exp(gamma_last - gamma))^T v_new
    r_sum = []
    for i in range(len(k)):
        e_end = segs.in_last(bm.per_column(jnp.exp(gamma_last - gamma[i])), docs, i)
        dk_end = snap.times_dh(v_new[i])
        dk[i] = dk[i] + dk_end * e_end
        r = bm.to_gate_shape(dk_end * kf[i] * e_end, per_key)
        dgamma[i] = dgamma[i] - r
        r_sum.append(jnp.sum(r, axis=0))
    hdh = snap.hdh()
    dgamma_last = bm.total(r_sum) + (hdh if per_key else jnp.sum(hdh)) * segs.start_decay(jnp.exp(gamma_last), docs)
    idx = lax.broadcasted_iota(jnp.int32, gamma[-1].shape, 0)
    dgamma[-1] = jnp.where(idx == gamma[-1].shape[0] - 1, dgamma[-1] + dgamma_last, dgamma[-1])
    return dq, dk, dgamma


def grad_through_wy(k: list, v: list, beta: list, gamma: list, v_new: list, t: list, snap: Snapshots, dv_new: list,
                    span: float = 0.0, docs: segs.Documents | None = None):
    """One chunk's gradients through ``v_new = u - w h`` and the WY transform (delta rule): ``(dk, d(gamma), dv,
    dbeta)`` float32 blocks, to add to :func:`grad_through_output`'s. ``t``: ``T``'s lower blocks; ``snap``: the
    state snapshot. ``span``: see :func:`block_math.one_matmul_pairs`; ``docs``: see :func:`grad_through_output`."""
    cd = k[0].dtype
    kf = [x.astype(F32) for x in k]
    per_key = gamma[0].ndim == 2
    eg = [segs.carried(bm.per_column(jnp.exp(g)), docs, i) for i, g in enumerate(gamma)]
    b = [x.astype(F32) for x in beta]
    # v_new = u - w h;  u = T (beta V);  w = T (beta exp(gamma) K);  T = (I + A)^-1. With du = dv_new and
    # dw = -dv_new h^T: T^T dw = -(T^T du) h^T, and dA = -T^T dT T^T = -(T^T du) u^T - (T^T dw) w^T
    # = -(T^T du) (u - w h)^T = -(T^T du) v_new^T (restricted to the strict lower triangle)
    t_du = bm.lower_matmul_t(t, [x.astype(cd) for x in dv_new])
    t_dw = [-snap.times_h(x.astype(cd)) for x in t_du]
    dk, dgamma, dv, db = [], [], [], []
    for i in range(len(k)):
        dv.append(t_du[i] * b[i][:, None])
        x = t_dw[i] * kf[i] * eg[i]
        dk.append(t_dw[i] * b[i][:, None] * eg[i])
        db.append(jnp.sum(t_du[i] * v[i].astype(F32), axis=1) + jnp.sum(x, axis=1))
        dgamma.append(bm.to_gate_shape(x * b[i][:, None], per_key))
    # A = beta_i gram(K, K): dbeta_i = sum_j dA_ij G_ij, dG = beta_i dA_ij
    da = segs.pairs([[-bm.dot(t_du[i].astype(cd), v_new[j].T) for j in range(i + 1)] for i in range(len(k))], docs)
    if per_key:
        y = bm.block_decay_matmul(da, k, gamma, strict=True, transpose=False, span=span)  # (dA . decay) K
        db = [x + jnp.sum(yi * ki, axis=1) for x, yi, ki in zip(db, y, kf, strict=True)]
        z = bm.block_decay_matmul([[x * b[i][:, None] for x in row] for i, row in enumerate(da)], k, gamma,
                                  strict=True, transpose=True, span=span)
        for i in range(len(k)):
            dk[i] = dk[i] + y[i] * b[i][:, None] + z[i]
            dgamma[i] = dgamma[i] + kf[i] * (y[i] * b[i][:, None] - z[i])
    else:  # one block
        db[0] = db[0] + jnp.sum(da[0][0] * bm.gram(k[0], k[0], gamma[0], strict=True), axis=1)
        (dk_row,), (dk_col,), (dgamma_a,) = gram_vjp([[da[0][0] * b[0][:, None]]], k, k, gamma, strict=True)
        dk[0] = dk[0] + dk_row + dk_col
        dgamma[0] = dgamma[0] + dgamma_a
    return dk, dgamma, dv, db
