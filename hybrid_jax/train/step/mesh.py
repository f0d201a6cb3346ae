"""The device mesh and the sharding of everything a train step touches, as one table of rules.

Mesh axes are ``("data", "fsdp", "context")`` over all devices of all processes. :data:`RULES` maps each logical
kind of array to the mesh axes it is split over; a leaf is split on its first dimension that the product of those
axis sizes divides, and replicated when none does:

* ``batch``: the batch dimension, over ``data`` and ``fsdp`` (every device gets different sequences; the devices
  of one ``context`` group share theirs).
* ``sequence``: the time dimension of the step's ``[B, T]`` inputs, targets and segment ids, over ``context``
  (sequence parallelism). The batch's ``[B, T+1]`` windows are only split on ``batch``: the step slices the
  inputs ``[:, :-1]`` and targets ``[:, 1:]`` and splits those (:data:`token_spec`), a local slice per device.
* ``params``: the float32 master weights, over ``fsdp`` (size 1 today: replicated).
* ``opt_state``: AdamW moments, over ``fsdp``, plus ``data`` and ``context`` with ``train.zero1`` (ZeRO-1: the
  devices that hold the same weights each update a part of them).

ZeRO-3 is therefore ``--config.mesh.fsdp=N``: parameters and moments become split over ``fsdp`` and XLA
inserts the all-gathers. The tests check that such a step equals the one-device step; it is not yet tuned
(no prefetch of the next layer's weights, no activation sharding rules).

``--config.mesh.context=N`` splits every sequence over ``N`` devices: the loss runs under a ``shard_map`` over the
whole mesh (``hybrid_jax.train.step.context_loss``) in which each recurrent mixer passes its state between shards as
an affine prefix, the short convs read a halo, and MLA gathers its latent (``hybrid_jax.parallel``). With
``context = 1`` (the default) the step is the one without the axis.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

AXES = ("data", "fsdp", "context")
CONTEXT = "context"
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "sequence": (CONTEXT,),
    "params": ("fsdp",),
    "opt_state": ("fsdp",),
    "opt_state_zero1": ("data", "fsdp", CONTEXT),
}


def maybe_initialize_distributed() -> None:
    """``jax.distributed.initialize(...)`` when launched as several processes (SLURM or ``hybrid_jax.launch``)."""
    from hybrid_jax.launch import initialize

    initialize()


def mesh_shape(mesh_cfg: ConfigDict, n_devices: int) -> tuple[int, int, int]:
    """``(data, fsdp, context)`` sizes; a -1 for data takes all remaining devices. Raises ValueError when they do not
    fit."""
    data, fsdp, context = mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.get("context", 1)
    for key, value in (("fsdp", fsdp), ("context", context)):
        if value < 1:
            raise ValueError(f"mesh.{key} must be >= 1, got {value}")
    rest = fsdp * context
    if data == -1:
        if n_devices % rest:
            fits = [c for c in range(1, n_devices + 1) if n_devices % (fsdp * c) == 0]
            hint = (f"with mesh.fsdp={fsdp}, mesh.context can be {', '.join(map(str, fits))}" if fits else
                    f"mesh.fsdp must divide {n_devices}")
            raise ValueError(f"mesh.fsdp={fsdp} x mesh.context={context} does not divide the {n_devices} devices "
                             f"({hint})")
        data = n_devices // rest
    if data < 1 or data * rest != n_devices:
        raise ValueError(f"mesh data={mesh_cfg.data} x fsdp={fsdp} x context={context} must use all {n_devices} "
                         "devices; set mesh.data=-1 to fill")
    return data, fsdp, context


def make_mesh(mesh_cfg: ConfigDict, devices: list | None = None) -> Mesh:
    """A ``("data", "fsdp", "context")`` mesh over ``devices`` (default: every device of every process)."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def spec_for(shape: tuple[int, ...], axes: tuple[str, ...], mesh: Mesh) -> PartitionSpec:
    """Split the first dimension of ``shape`` divisible by the size of ``axes`` over them; else replicate."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    if size == 1:
        return PartitionSpec()
    for dim, n in enumerate(shape):
        if n % size == 0:
            return PartitionSpec(*([None] * dim), axes)
    return PartitionSpec()


def shardings(tree: Any, kind: str, mesh: Mesh) -> Any:
    """``NamedSharding`` per leaf of ``tree`` (arrays or ShapeDtypeStructs) under rule ``RULES[kind]``."""
    return jax.tree.map(lambda x: NamedSharding(mesh, spec_for(np.shape(x), RULES[kind], mesh)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[batch, ...]`` arrays split over ``RULES["batch"]`` on their first dimension."""
    return NamedSharding(mesh, PartitionSpec(RULES["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch is split (the product of the ``batch`` rule's axes)."""
    return math.prod(mesh.shape[a] for a in RULES["batch"])


def context_shards(mesh: Mesh | jax.sharding.AbstractMesh) -> int:
    """How many ways each sequence is split (the ``context`` axis' size; 1 for a mesh without it)."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(CONTEXT, 1)


def token_spec() -> PartitionSpec:
    """``[B, T]`` inputs, targets and segment ids inside the step: batch over ``batch``, time over ``sequence``."""
    return PartitionSpec(RULES["batch"], RULES["sequence"])
