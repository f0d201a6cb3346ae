"""One way to build what a run's steps need from a config and a set of devices: the mesh, the accumulation, the
optimizer, the train state (or its abstract shapes), its shardings and the jitted step. The training loop, the doctor
and every benchmark build their trainer here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from ml_collections import ConfigDict

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.model import HybridLM
from hybrid_jax.train.config_checks import ConfigError, check_config
from hybrid_jax.train.step import mesh as mesh_lib
from hybrid_jax.train.step.optim import make_optimizer
from hybrid_jax.train.step.train_step import State, init_state, make_train_step


@dataclasses.dataclass
class Trainer:
    """``state``: the train state on the mesh (None when built abstract); ``abstract_state``: its
    ``ShapeDtypeStruct`` leaves with their shardings (a restore target, or what the step lowers on); ``step``: the
    jitted ``step(state, batch) -> (state, metrics)`` (``step.lower`` too)."""

    mesh: Mesh
    accum: int
    optimizer: optax.GradientTransformation
    graphdef: nnx.GraphDef
    state: State | None
    abstract_state: State
    shardings: dict[str, Any]
    step: Any
    batch_sharding: NamedSharding

    def put(self, batch: Batch) -> Batch:
        """This process's host batch as global arrays split over the mesh's batch axes."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch)

    def abstract_batch(self, seq_len: int, global_batch: int, segments: bool = False) -> Batch:
        """A ``[global_batch, seq_len + 1]`` int32 batch of ``ShapeDtypeStruct`` (for lowering without data)."""
        x = jax.ShapeDtypeStruct((global_batch, seq_len + 1), jax.numpy.int32, sharding=self.batch_sharding)
        return Batch(x, x if segments else None)


def make_mesh(config: ConfigDict, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The config's ``data x fsdp x context`` mesh over ``devices`` (default: all of every process); ConfigError if it
    does not fit."""
    try:
        return mesh_lib.make_mesh(config.mesh, None if devices is None else list(devices))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_trainer(config: ConfigDict, devices: Sequence[jax.Device] | None = None, *, abstract: bool = False
                  ) -> Trainer:
    """The trainer of ``config`` on ``devices``: the config is checked (ConfigError), the model and optimizer state
    are built directly in their shardings (``abstract``: only their shapes, nothing allocated)."""
    mesh = make_mesh(config, devices)
    accum = check_config(config, mesh_lib.batch_shards(mesh))
    t = config.train
    tx = make_optimizer(t)
    model = lambda: HybridLM(config.model, rngs=nnx.Rngs(t.seed))  # noqa: E731
    graphdef, shapes, shardings = init_state(model, tx, mesh, zero1=t.zero1, seed=t.seed, abstract=abstract)
    state = None if abstract else shapes
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    step = make_train_step(graphdef, tx, t, mesh, shardings, accum=accum)
    return Trainer(mesh, accum, tx, graphdef, state, abstract_state, shardings, step, mesh_lib.batch_sharding(mesh))
