"""The train state and the one jitted train step: accumulate gradients over micro-batches, clip, AdamW, skip.

The state is a plain dict (what Orbax saves):

* ``params``: float32 master weights, the model's ``nnx.Param`` tree as a pure dict.
* ``opt_state``: the optax state (moments sharded on ``data`` with ZeRO-1).
* ``step``: batches consumed; ``skipped``: updates skipped in total; ``skipped_in_a_row``: since the last good one.
* ``rng``: the run's base PRNG key (uint32 ``[2]``), saved so that a resumed run continues the same streams.

A step whose loss, gradient norm, update norm or updated weights' or optimizer state's norm is not finite (a
norm that overflows float32 counts) leaves ``params`` and ``opt_state`` bit-identical (a ``jnp.where`` on every
leaf inside the step), and only the counters move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.train.step import mesh as mesh_lib
from hybrid_jax.train.step.context_loss import context_batch_loss
from hybrid_jax.train.step.loss import model_loss
from hybrid_jax.train.step.schedule import learning_rate_schedule

State = dict[str, Any]
ModelFactory = Callable[[], nnx.Module]


def init_state(
    model_factory: ModelFactory, tx: optax.GradientTransformation, mesh: Mesh, *, zero1: bool, seed: int,
    abstract: bool = False,
) -> tuple[nnx.GraphDef, State, dict[str, NamedSharding]]:
    """Build the model and optimizer state directly in their shardings (never whole on one device); ``abstract``:
    only their ``ShapeDtypeStruct`` (nothing allocated).

    Returns ``(graphdef, state, state_shardings)``; ``nnx.merge(graphdef, state["params"])`` is the model.
    """

    def init() -> State:
        _, params = nnx.split(model_factory(), nnx.Param)
        params = nnx.to_pure_dict(params)
        return dict(
            params=params,
            opt_state=tx.init(params),
            step=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            skipped_in_a_row=jnp.zeros((), jnp.int32),
            rng=jax.random.PRNGKey(seed),
        )

    graphdef, _ = nnx.split(nnx.eval_shape(model_factory), nnx.Param)
    shapes = jax.eval_shape(init)
    shardings = state_shardings(shapes, mesh, zero1=zero1)
    if abstract:
        return graphdef, shapes, shardings
    return graphdef, jax.jit(init, out_shardings=shardings)(), shardings


def state_shardings(abstract_state: State, mesh: Mesh, *, zero1: bool) -> dict[str, Any]:
    """Params by the ``params`` rule, optimizer state by ``opt_state`` (``opt_state_zero1``), scalars replicated."""
    out = {k: jax.tree.map(lambda _: mesh_lib.replicated(mesh), v) for k, v in abstract_state.items()}
    out["params"] = mesh_lib.shardings(abstract_state["params"], "params", mesh)
    opt_rule = "opt_state_zero1" if zero1 else "opt_state"
    out["opt_state"] = mesh_lib.shardings(abstract_state["opt_state"], opt_rule, mesh)
    return out


def _finite_norm(tree: Any) -> jax.Array:
    """True when the global norm of ``tree``'s floating-point leaves is finite (no NaN, inf or float32 overflow)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.isfinite(optax.global_norm(leaves))


def split_micro_batches(batch: jax.Array, accum: int, shards: int) -> jax.Array:
    """``[B, L]`` (split over ``shards`` devices on B) -> ``[accum, B // accum, L]`` micro-batches.

    Device ``d`` holds rows ``[d * B/shards, (d+1) * B/shards)``; micro-batch ``a`` takes the ``a``-th
    ``B/(shards*accum)`` rows of every device's block, so no data moves between devices.
    """
    b, *rest = batch.shape
    micro = batch.reshape(shards, accum, b // (shards * accum), *rest).swapaxes(0, 1)
    return micro.reshape(accum, b // accum, *rest)


def batch_loss(params: dict, graphdef: nnx.GraphDef, batch: Batch, chunk_size: int) -> jax.Array:
    """Mean next-token cross-entropy of the model ``(graphdef, params)`` on ``batch`` (its documents kept apart when
    it has segment ids). Under a mesh (``jax.set_mesh``) whose ``context`` axis is larger than 1, each sequence is
    split over it (:func:`~hybrid_jax.train.step.context_loss.context_batch_loss`)."""
    if mesh_lib.context_shards(jax.sharding.get_abstract_mesh()) > 1:
        return context_batch_loss(params, graphdef, batch, chunk_size)
    segment_ids = None if batch.segment_ids is None else batch.segment_ids[:, :-1]
    return model_loss(nnx.merge(graphdef, params), batch.tokens[:, :-1], batch.tokens[:, 1:], segment_ids,
                      chunk_size=chunk_size)


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    train_cfg: ConfigDict,
    mesh: Mesh,
    shardings: dict[str, Any],
    *,
    accum: int,
) -> Callable[[State, jax.Array], tuple[State, dict[str, jax.Array]]]:
    """The jitted ``step(state, batch) -> (state, metrics)`` with donated state (``batch``: a
    :class:`~hybrid_jax.data.pipeline.Batch` of ``[B, T+1]`` int32 arrays); ``step.lower(state, batch)`` lowers it
    ahead of time (abstract arguments allowed).

    ``metrics``: float32 ``loss`` (mean over the batch's tokens), ``grad_norm`` (before clipping), ``lr``
    (of this update), bool ``finite``, int32 ``skipped`` and ``skipped_in_a_row``.
    """
    schedule = learning_rate_schedule(train_cfg)
    shards = mesh_lib.batch_shards(mesh)
    micro_sharding = NamedSharding(mesh, PartitionSpec(None, mesh_lib.RULES["batch"]))
    chunk = train_cfg.loss_chunk_size

    def step(state: State, batch: Batch):
        params = state["params"]
        micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(split_micro_batches(x, accum, shards),
                                                                        micro_sharding), batch)

        def accumulate(carry, micro_batch):
            loss, grads = jax.value_and_grad(lambda p: batch_loss(p, graphdef, micro_batch, chunk))(params)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
        grads = jax.lax.with_sharding_constraint(grads, shardings["params"])

        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = dict(params=optax.apply_updates(params, updates), opt_state=opt_state)
        # the update and the updated weights too: finite grads can still give NaN or overflowing weights (a
        # huge lr, a damaged optimizer state); a norm that overflows float32 counts as non-finite
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _finite_norm((updates, new))
        old = dict(params=params, opt_state=state["opt_state"])
        kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        bad = (~finite).astype(jnp.int32)
        out = dict(
            kept,
            step=state["step"] + 1,
            skipped=state["skipped"] + bad,
            skipped_in_a_row=(state["skipped_in_a_row"] + 1) * bad,
            rng=state["rng"],
        )
        metrics = dict(
            loss=loss,
            grad_norm=grad_norm,
            lr=schedule(state["step"] - state["skipped"]),
            finite=finite,
            skipped=out["skipped"],
            skipped_in_a_row=out["skipped_in_a_row"],
        )
        return out, metrics

    batch_sh = mesh_lib.batch_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=0)

    def run(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        with jax.set_mesh(mesh):  # traced under the mesh: the Pallas kernels then run per batch shard (shard_map)
            return jitted(state, batch)

    def lower(state: State, batch: Batch) -> jax.stages.Lowered:
        """The step lowered for (possibly abstract, sharded) arguments: ``.compile()`` ahead of time."""
        with jax.set_mesh(mesh):
            return jitted.lower(state, batch)

    run.lower = lower
    return run
