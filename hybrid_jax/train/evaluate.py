"""Validation loss during training: the mean next-token cross-entropy on a fixed set of held-out windows.

The windows (:func:`hybrid_jax.data.validation.validation_windows`) are read once at start, ``train.eval_batches``
batches of ``micro_batch_size x data shards`` windows (one micro step's worth per device, so memory is never
above training's), and placed on the devices once. Every evaluation scores the same tokens with the same
chunked cross-entropy as training (forward only), so numbers are comparable across steps, runs and resumes.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from hybrid_jax.data.validation import validation_windows
from hybrid_jax.train import mesh as mesh_lib
from hybrid_jax.train.loss import cross_entropy
from hybrid_jax.train.progress import TrainProgress
from hybrid_jax.train.validate import ConfigError


def load_windows(config: ConfigDict, batch_shards: int) -> tuple[np.ndarray, str]:
    """``[batches, batch, seq_len + 1]`` int32 validation windows and a one-line description of them.

    Raises :class:`ConfigError` when the validation data cannot be read or holds less than one batch.
    """
    t = config.train
    batch = t.micro_batch_size * batch_shards
    try:
        windows = validation_windows(config, t.eval_batches * batch)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(str(e)) from None
    batches = len(windows) // batch
    if batches == 0:
        raise ConfigError(f"data.validation_path={config.data.validation_path} gives {len(windows)} windows of "
                          f"{t.seq_len + 1} tokens, fewer than one validation batch (micro_batch_size x data shards "
                          f"= {batch}); use more documents or a smaller train.micro_batch_size")
    note = (f"validation: {batches} batches x {batch} windows x {t.seq_len} tokens of {config.data.validation_path}"
            + (f" (only {batches} of train.eval_batches={t.eval_batches} fit in it)" if batches < t.eval_batches
               else "") + f", every {t.eval_every} steps and at the end")
    return windows[: batches * batch].reshape(batches, batch, *windows.shape[1:]), note


class Evaluator:
    """``evaluator(params) -> {"val_loss", "val_ppl"}`` on the fixed windows (one jitted forward per batch)."""

    def __init__(self, graphdef: nnx.GraphDef, windows: np.ndarray, train_cfg: ConfigDict, mesh: Mesh,
                 param_shardings: dict):
        sharding = mesh_lib.batch_sharding(mesh)
        self.batches = [jax.device_put(w, sharding) for w in windows]
        self.mesh = mesh
        chunk = train_cfg.loss_chunk_size

        def loss(params: dict, tokens: jax.Array) -> jax.Array:
            model = nnx.merge(graphdef, params)
            segment_ids = None
            if tokens.ndim == 3:  # data.document_mask: [B, 2, T+1] tokens and segment ids, as in the train step
                tokens, segment_ids = tokens[:, 0], tokens[:, 1, :-1]
            h = model.features(tokens[:, :-1], segment_ids)
            return cross_entropy(h, jnp.asarray(model.embedding), tokens[:, 1:], chunk_size=chunk)

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
