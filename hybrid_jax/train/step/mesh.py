"""The device mesh and the sharding of everything a train step touches, as one table of rules.

Mesh axes are ``("data", "fsdp")`` over all devices of all processes. :data:`RULES` maps each logical kind of
array to the mesh axes it is split over; a leaf is split on its first dimension that the product of those
axis sizes divides, and replicated when none does:

* ``batch``: the batch dimension, over ``data`` and ``fsdp`` (every device gets different sequences).
* ``params``: the float32 master weights, over ``fsdp`` (size 1 today: replicated).
* ``opt_state``: AdamW moments, over ``fsdp``, plus ``data`` with ``train.zero1`` (ZeRO-1).

ZeRO-3 is therefore ``--config.mesh.fsdp=N``: parameters and moments become split over ``fsdp`` and XLA
inserts the all-gathers. The tests check that such a step equals the one-device step; it is not yet tuned
(no prefetch of the next layer's weights, no activation sharding rules).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

AXES = ("data", "fsdp")
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "params": ("fsdp",),
    "opt_state": ("fsdp",),
    "opt_state_zero1": ("data", "fsdp"),
}


def maybe_initialize_distributed() -> None:
    """``jax.distributed.initialize(...)`` when launched as several processes (SLURM or ``hybrid_jax.launch``)."""
    from hybrid_jax.launch import initialize

    initialize()


def mesh_shape(mesh_cfg: ConfigDict, n_devices: int) -> tuple[int, int]:
    """``(data, fsdp)`` sizes; a -1 takes all remaining devices. Raises ValueError when they do not fit."""
    data, fsdp = mesh_cfg.data, mesh_cfg.fsdp
    if fsdp < 1:
        raise ValueError(f"mesh.fsdp must be >= 1, got {fsdp}")
    if data == -1:
        if n_devices % fsdp:
            raise ValueError(f"mesh.fsdp={fsdp} does not divide the {n_devices} devices")
        data = n_devices // fsdp
    if data < 1 or data * fsdp != n_devices:
        raise ValueError(
            f"mesh data={mesh_cfg.data} x fsdp={fsdp} must use all {n_devices} devices; set mesh.data=-1 to fill"
        )
    return data, fsdp


def make_mesh(mesh_cfg: ConfigDict, devices: list | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over ``devices`` (default: every device of every process)."""
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
