"""Train a PyTorch causal LM exactly as our trainer trains (for parity checks against our JAX runs).

Our optimizer (``hybrid_jax.train.step.optim``) in PyTorch terms: global-norm gradient clip, then AdamW with
``b1, b2, eps``, decoupled weight decay on tensors of two or more dimensions except ``A_log`` / ``dt_bias`` / ``D``,
and the learning rate of our schedule at each step (read from the optax schedule itself). The loss is the mean
next-token cross-entropy in float32 over ``batch[:, 1:]`` given ``batch[:, :-1]``, as our train step computes it.
Works for any ``transformers``-style model whose call returns ``.logits``: an FLA model, or our exported HF model
(``modeling_hybrid.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.train.step.optim import decays


def param_decays(name: str, ndim: int) -> bool:
    """Our weight-decay rule (:func:`hybrid_jax.train.step.optim.decays`) for a PyTorch parameter name
    (``a.b.A_log``)."""
    return decays(name.rsplit(".", 1)[-1], ndim)


def make_optimizer(model, train_cfg: ConfigDict):
    """``torch.optim.AdamW`` with our two parameter groups (decayed / not); the learning rate is set per step."""
    import torch

    named = list(model.named_parameters())
    groups = [dict(params=[p for n, p in named if param_decays(n, p.ndim)], weight_decay=train_cfg.weight_decay),
              dict(params=[p for n, p in named if not param_decays(n, p.ndim)], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=0.0, betas=(train_cfg.b1, train_cfg.b2), eps=train_cfg.eps)


def train_torch(model, batches: Iterable[np.ndarray], train_cfg: ConfigDict, lr_at: Callable[[int], float], *,
                autocast_dtype=None, log: Callable[[str], None] = lambda s: None) -> list[float]:
    """Train ``model`` one step per ``[B, T+1]`` token batch; returns the loss of each step, before its update.

    ``lr_at(step)``: the learning rate of update ``step`` (0-based), e.g. ``float(optax_schedule(step))``.
    ``autocast_dtype``: e.g. ``torch.bfloat16`` for mixed precision (float32 master weights); None: the model's dtype.
    """
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    opt = make_optimizer(model, train_cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step, batch in enumerate(batches):
        x = torch.from_numpy(np.asarray(batch)).long().to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train_cfg.clip_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        log(f"step {step + 1}: loss {losses[-1]:.5f}")
    return losses
