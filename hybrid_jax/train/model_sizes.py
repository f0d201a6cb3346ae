"""The model config's sizes: every size, count and rank of ``model`` must be a positive integer."""

from __future__ import annotations

from ml_collections import ConfigDict

MAY_BE_ZERO = frozenset({"chunk_size"})  # 0: tuned per GPU and mixer
_SIZE_WORDS = ("size", "dim", "heads", "rank", "layers", "groups", "expand", "vocab")


def check_model_sizes(model: ConfigDict, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` (one line naming the key) for a size, count or rank of ``model`` that is not positive."""
    for key, value in _flat(model.to_dict()):
        if not any(word in key for word in _SIZE_WORDS) or isinstance(value, bool) or not isinstance(value, int):
            continue
        if value < 0 or (value == 0 and key not in MAY_BE_ZERO):
            raise error(f"model.{key}={value} must be a positive integer")


def _flat(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
