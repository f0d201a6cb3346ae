"""The optimizer: AdamW on the learning-rate schedule (:mod:`.schedule`), weight decay on matrices only, global-norm
clip.

Weight-decay rule (Megatron's, as Primus trains): a parameter is decayed when it has two or more dimensions,
so every projection, the conv filters and the tied embedding are decayed, while norm scales, biases and the
per-head ``dt_bias`` / ``D`` / GDN ``A_log`` vectors are not. Names in :data:`NO_DECAY` are never decayed
whatever their shape (our ``A_log`` / ``dt_bias`` / ``D`` may be stored with extra unit axes); Primus's
KDA ``A_log`` is the one ``[1,1,H,1]`` exception that Megatron decays by accident, which we do not copy.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from ml_collections import ConfigDict

from hybrid_jax.train.step.schedule import learning_rate_schedule

NO_DECAY = frozenset({"A_log", "dt_bias", "D"})


def decays(name: str, ndim: int) -> bool:
    """The weight-decay rule for a parameter's (last) name and number of dimensions."""
    return ndim >= 2 and name not in NO_DECAY


def decay_mask(params: Any) -> Any:
    """Pytree of bools like ``params``: True where weight decay applies (:func:`decays`)."""

    def leaf_decays(path, leaf) -> bool:
        return decays(getattr(path[-1], "key", getattr(path[-1], "name", str(path[-1]))), leaf.ndim)

    return jax.tree_util.tree_map_with_path(leaf_decays, params)


def make_optimizer(train_cfg: ConfigDict) -> optax.GradientTransformation:
    """Clip the global gradient norm to ``clip_norm``, then AdamW (``b1, b2, eps, weight_decay``) on the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(train_cfg.clip_norm),
        optax.adamw(
            learning_rate_schedule(train_cfg),
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            eps=train_cfg.eps,
            weight_decay=train_cfg.weight_decay,
            mask=decay_mask,
        ),
    )
