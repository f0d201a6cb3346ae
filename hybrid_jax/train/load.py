"""``hybrid_jax.load(workdir, step=None) -> (model, config)``: a trained model for notebooks, export and eval."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax.config import from_json
from hybrid_jax.model import HybridLM
from hybrid_jax.train.checkpoint import Checkpointer


def load(workdir: str | Path, step: int | None = None) -> tuple[HybridLM, ConfigDict]:
    """The model saved in ``workdir`` at ``step`` (default: the newest complete checkpoint) and its run config.

    Only the parameters are read (not the optimizer state), onto the first local device.
    """
    workdir = Path(workdir)
    config = from_json((workdir / "config.json").read_text())
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0))), nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(abstract))
    checkpointer = Checkpointer(workdir, read_only=True)
    try:
        params = checkpointer.restore({"params": target}, None, step)["params"]
    finally:
        checkpointer.close()
    return nnx.merge(graphdef, params), config
