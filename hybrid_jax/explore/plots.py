"""Plots of a captured :class:`~hybrid_jax.explore.capture.Trace` (matplotlib figures, saved as PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from ml_collections import ConfigDict

from hybrid_jax.explore.capture import (
    RecurrentLayer,
    Trace,
    activation_norms,
    chain_probs,
    next_token_table,
    target_probs,
    tokenizer_of,
)


def _sublayer_labels(trace: Trace) -> list[str]:
    return [f"{i}{ch}" for i, ch in enumerate(trace.plan)]


def _token_axis(ax, labels: list[str], axis: str = "x", most: int = 32) -> None:
    """Tick ``ax``'s ``axis`` with the tokens (every n-th of them when there are more than ``most``)."""
    if not labels:
        return
    every = max(1, -(-len(labels) // most))
    positions = np.arange(0, len(labels), every)
    shown = [labels[i] for i in positions]
    if axis == "x":
        ax.set_xticks(positions, shown, rotation=90, fontsize=7)
    else:
        ax.set_yticks(positions, shown, fontsize=7)


def plot_activation_norms(trace: Trace) -> Figure:
    """Residual-stream RMS along depth (line) and each sublayer's update RMS (bars, coloured by kind)."""
    norms = activation_norms(trace)
    colors = {"mla": "tab:red", "mlp": "tab:gray", "gdn": "tab:blue", "kda": "tab:green", "mamba2": "tab:purple"}
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.add_subplot()
    depth = np.arange(len(trace.kinds))
    ax.bar(depth + 1, norms["update"], color=[colors[k] for k in trace.kinds], alpha=0.6, label="sublayer update")
    ax.plot(np.arange(len(trace.residual)), norms["residual"], "k.-", label="residual stream")
    ax.set_xticks(np.arange(len(trace.residual)), ["emb"] + _sublayer_labels(trace))
    ax.set_xlabel("after sublayer (index + plan character)")
    ax.set_ylabel("RMS over channels, mean over tokens")
    ax.set_title("Activation norms along depth  (bars: " + ", ".join(
        f"{k}={c.split(':')[1]}" for k, c in colors.items() if k in trace.kinds) + ")")
    ax.legend()
    return fig


def plot_recurrent_states(layers: list[RecurrentLayer]) -> Figure:
    """One row per recurrent layer: ``||S_t||_F`` per head over time, and effective memory per head over time."""
    fig = Figure(figsize=(10, 2.6 * max(len(layers), 1)), layout="constrained")
    axes = fig.subplots(max(len(layers), 1), 2, squeeze=False)
    for row, layer in zip(axes, layers, strict=False):
        heads = [f"head {h}" for h in range(layer.state_norm.shape[1])]
        row[0].plot(layer.state_norm, label=heads)
        row[0].set_ylabel(f"sublayer {layer.index} {layer.kind}\n||S_t||_F")
        row[1].plot(layer.memory, label=heads)
        row[1].set_yscale("log")
        row[1].set_ylabel("effective memory (tokens)")
        row[1].legend(fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        for ax in row:
            _token_axis(ax, layer.labels)
    axes[0, 0].set_title("recurrent state norm per head")
    axes[0, 1].set_title("effective memory per head (decay only)")
    for ax in axes[-1]:
        ax.set_xlabel("token")
    return fig


def plot_gates(layers: list[RecurrentLayer]) -> Figure:
    """One row per recurrent layer: decay ``exp(g)`` [head x time], and beta (GDN/KDA) or dt (Mamba2)."""
    fig = Figure(figsize=(10, 2.4 * max(len(layers), 1)), layout="constrained")
    axes = fig.subplots(max(len(layers), 1), 2, squeeze=False)
    for row, layer in zip(axes, layers, strict=False):
        image = row[0].imshow(layer.decay.T, aspect="auto", interpolation="nearest", vmin=0, vmax=1, cmap="viridis")
        fig.colorbar(image, ax=row[0])
        row[0].set_ylabel(f"sublayer {layer.index} {layer.kind}\nhead")
        second, name = (layer.beta, "beta") if layer.beta is not None else (layer.dt, "dt")
        image = row[1].imshow(second.T, aspect="auto", interpolation="nearest", cmap="magma")
        fig.colorbar(image, ax=row[1], label=name)
        for ax in row:
            ax.set_yticks(np.arange(layer.decay.shape[1]))
            _token_axis(ax, layer.labels)
    axes[0, 0].set_title("decay exp(g) per token (KDA: mean over key channels)")
    axes[0, 1].set_title("beta (GDN, KDA) / dt (Mamba2)")
    for ax in axes[-1]:
        ax.set_xlabel("token")
    return fig


def plot_attention(trace: Trace, max_heads: int = 8) -> Figure:
    """One row per MLA layer, one column per head: the causal attention probabilities (query down, key across)."""
    rows = sorted(trace.attention)
    heads = min(max_heads, max((trace.attention[i].shape[0] for i in rows), default=1))
    fig = Figure(figsize=(2.2 * heads, 2.4 * max(len(rows), 1)), layout="constrained")
    axes = fig.subplots(max(len(rows), 1), heads, squeeze=False)
    image = None
    for r, index in enumerate(rows):
        for h in range(heads):
            image = axes[r, h].imshow(trace.attention[index][h], cmap="Blues", norm=PowerNorm(0.5, vmin=0, vmax=1),
                                      interpolation="nearest")
            axes[r, h].set_title(f"sublayer {index} head {h}", fontsize=8)
            _token_axis(axes[r, h], trace.labels, "x", most=16)
            _token_axis(axes[r, h], trace.labels if h == 0 else [], "y", most=16)
            if h:
                axes[r, h].set_yticks([])
    axes[0, 0].set_ylabel("query token")
    axes[-1, 0].set_xlabel("key token")
    if image is not None:
        fig.colorbar(image, ax=axes, label="attention probability", shrink=0.8)
    fig.suptitle("MLA attention maps")
    return fig


def plot_next_token(trace: Trace, config: ConfigDict, k: int = 8) -> Figure:
    """Left: the ``k`` most likely next tokens after the prompt. Right: the probability of each actual next token."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1, 2))
    labels, probs = zip(*next_token_table(trace, config, k), strict=True)
    left.barh(np.arange(len(labels))[::-1], probs, color="tab:blue")
    left.set_yticks(np.arange(len(labels))[::-1], labels, fontsize=8)
    left.set_xlim(0, 1)
    left.set_xlabel("probability")
    left.set_title(f"next token after position {len(trace.tokens) - 1}")
    positions = np.arange(1, len(trace.tokens))
    right.plot(positions, target_probs(trace), ".-", label="model")
    if tokenizer_of(config) is None:
        right.plot(positions, chain_probs(trace.tokens, config), "x", color="gray", label="mock chain (the truth)")
    right.legend(loc="upper right")
    _token_axis(right, trace.labels)
    right.set_ylim(0, 1)
    right.set_xlabel("predicted token")
    right.set_ylabel("p(actual next token)")
    right.set_title("probability of the token that came next")
    return fig


def save_figure(fig: Figure, directory: str | Path, name: str) -> Path:
    """Write ``fig`` as ``directory/name.png`` (directory created) and return the path."""
    path = Path(directory) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
