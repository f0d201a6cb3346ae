"""The train state and the one jitted train step: accumulate gradients over micro-batches, clip, AdamW, skip.

The state is a plain dict (what Orbax saves):

* ``params``: float32 master weights, the model's ``nnx.Param`` tree as a pure dict.
* ``opt_state``: the optax state (moments sharded on ``data`` with ZeRO-1).
* ``step``: batches consumed; ``skipped``: updates skipped in total; ``skipped_in_a_row``: since the last good one.
* ``rng``: the run's base PRNG key (uint32 ``[2]``), saved so that a resumed run continues the same streams.

A step whose loss, gradient norm, update norm or updated weights' or optimizer state's norm is not finite (a
norm that overflows float32 counts) leaves ``params`` and ``opt_state`` bit-identical (a ``jnp.where`` on every
leaf inside the step), and only the counters move. The optimizer goes over the weights twice for that: once for
the norms alone, once more (the same update computed again) for what is written, so that the new weights never
make a round trip through memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.kernels import tuning
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


def _optimizer_step(tx: optax.GradientTransformation, grads: Any, old: State) -> tuple[Any, State]:
    """One ``tx`` update of ``old = dict(params, opt_state)`` by ``grads`` (like ``params``):
    ``(updates, dict(params=new params, opt_state=new opt_state))``."""
    updates, opt_state = tx.update(grads, old["opt_state"], old["params"])
    return updates, dict(params=optax.apply_updates(old["params"], updates), opt_state=opt_state)


def _sum_of_squares(trees: list[Any]) -> jax.Array:
    """float32 sum of ``x**2`` over every element of the floating-point leaves of ``trees``, ``N`` pytrees of one
    structure: per leaf position the ``N`` arrays' squares are added element-wise, then reduced once.

    One reduction per weight rather than ``N``: XLA then fuses everything that produces the ``N`` arrays (the update,
    the new weights, the new moments) into it, instead of writing a shared producer out to feed several reductions.
    """

    def per_position(*xs: jax.Array) -> jax.Array:
        squares = [jnp.square(x.astype(jnp.float32)) for x in xs if jnp.issubdtype(x.dtype, jnp.floating)]
        return jnp.sum(sum(squares[1:], squares[0])) if squares else jnp.zeros((), jnp.float32)

    return sum(jax.tree.leaves(jax.tree.map(per_position, *trees)), jnp.zeros((), jnp.float32))


def _update_is_finite(tx: optax.GradientTransformation, grads: Any, old: State) -> jax.Array:
    """Scalar bool: the global norm of the update, the new weights and the new optimizer state is finite (no NaN,
    inf or float32 overflow; the norm is finite exactly when its square is).

    Only this scalar leaves the pass: XLA fuses the update into one reduction per weight, which reads g, m, v, p and
    writes nothing of a weight's size; :func:`_apply_if_finite` computes the update again for what is written. The
    optimizer state's subtrees with the params' structure (Adam's moments) are summed per weight with the update and
    the new weights (:func:`_sum_of_squares`), its other leaves (step counts) on their own.
    """
    updates, new = _optimizer_step(tx, grads, old)
    structure = jax.tree.structure(new["params"])
    like_params = lambda x: jax.tree.structure(x) == structure  # noqa: E731
    parts = jax.tree.leaves(new["opt_state"], is_leaf=like_params)
    moments = [x for x in parts if like_params(x)]
    others = [x for x in parts if not like_params(x)]
    return jnp.isfinite(_sum_of_squares([updates, new["params"], *moments]) + _sum_of_squares([others]))


def _apply_if_finite(tx: optax.GradientTransformation, grads: Any, old: State, finite: jax.Array) -> State:
    """``dict(params, opt_state)`` after the ``tx`` update where ``finite`` (scalar bool), else ``old``
    bit-identically.

    The update is the same computation as in :func:`_update_is_finite` (so the same bits), on ``old`` passed through
    an optimization barrier with ``finite``: XLA can then neither merge the two passes (common subexpressions), which
    would write the new weights out in the norm pass and read them back here, nor start this one before ``finite`` is
    known. One element-wise pass per weight: read g, m, v, p; write p, m, v (in place: the state is donated).
    """
    finite, old = jax.lax.optimization_barrier((finite, old))
    _, new = _optimizer_step(tx, grads, old)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


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


# XLA's compile options for the step, per architecture (benchmarks/NOTES.md "XLA's Triton GEMMs on sm90")
STEP_XLA_OPTIONS: dict[str, dict[str, bool]] = {"sm90": {"xla_gpu_enable_triton_gemm": False}}


def step_xla_options(device: jax.Device) -> dict[str, bool]:
    """The compile options of the train step on ``device``'s architecture (:data:`STEP_XLA_OPTIONS`), less any
    that the user's ``XLA_FLAGS`` sets: the user's value stands."""
    flags = os.environ.get("XLA_FLAGS", "")
    options = STEP_XLA_OPTIONS.get(tuning.arch_of(device.device_kind, device.platform), {})
    return {name: value for name, value in options.items() if not re.search(rf"--{name}(=|\s|$)", flags)}


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
    ahead of time (abstract arguments allowed); ``step.xla_options``: the compile options it was jitted with
    (:func:`step_xla_options`).

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
        old = dict(params=params, opt_state=state["opt_state"])
        # the update and the updated weights too: finite grads can still give NaN or overflowing weights (a
        # huge lr, a damaged optimizer state); a norm that overflows float32 counts as non-finite
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _update_is_finite(tx, grads, old)
        kept = _apply_if_finite(tx, grads, old, finite)

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
    options = step_xla_options(mesh.devices.flat[0])
    jitted = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=0,
                     compiler_options=options)

    def run(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        with jax.set_mesh(mesh):  # traced under the mesh: the Pallas kernels then run per batch shard (shard_map)
            return jitted(state, batch)

    def lower(state: State, batch: Batch) -> jax.stages.Lowered:
        """The step lowered for (possibly abstract, sharded) arguments: ``.compile()`` ahead of time."""
        with jax.set_mesh(mesh):
            return jitted.lower(state, batch)

    run.lower = lower
    run.xla_options = options
    return run
