"""Validation loss during training: the mean next-token cross-entropy on a fixed set of held-out windows.

The windows (:func:`hybrid_jax.data.heldout.heldout_windows`, read once by the preflight) are ``train.eval_batches``
batches of ``micro_batch_size x data shards`` windows (one micro step's worth per device, so memory is never above
training's), placed on the devices once. Every evaluation scores the same tokens with the same chunked
cross-entropy as training (forward only), so numbers are comparable across steps, runs and resumes.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.train.report.progress import TrainProgress
from hybrid_jax.train.step import mesh as mesh_lib
from hybrid_jax.train.step.train_step import batch_loss


class HeldoutLoss:
    """``heldout(params) -> {"val_loss", "val_ppl", "seconds"}`` on fixed windows (one jitted forward per batch).

    ``batches``: ``[batches, batch, seq_len + 1]`` int32 windows (and their segment ids) as a :class:`Batch`."""

    def __init__(self, graphdef: nnx.GraphDef, batches: Batch, chunk_size: int, mesh: Mesh, param_shardings: dict):
        sharding = mesh_lib.batch_sharding(mesh)
        self.batches = [jax.device_put(Batch(*(None if x is None else x[i] for x in batches)), sharding)
                        for i in range(len(batches.tokens))]
        self.mesh = mesh
        loss = lambda params, batch: batch_loss(params, graphdef, batch, chunk_size)  # noqa: E731
        self._loss = jax.jit(loss, in_shardings=(param_shardings, sharding))
        self._compiled = False

    def __call__(self, params: dict, progress: TrainProgress | None = None) -> dict[str, float]:
        """The validation loss (nats) and perplexity of ``params``, and the ``seconds`` it took (compile included:
        the first call compiles, shown on ``progress``)."""
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            if not self._compiled and progress is not None:
                with progress.compiling("the validation step"):
                    jax.block_until_ready(self._loss(params, self.batches[0]))
            self._compiled = True
            losses = [self._loss(params, b) for b in self.batches]
        value = float(np.mean(np.asarray(jax.device_get(losses), np.float64)))
        return dict(val_loss=value, val_ppl=math.exp(min(value, 700.0)), seconds=time.perf_counter() - start)
