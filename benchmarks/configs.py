"""Config files and ``--config.KEY=VALUE`` overrides for the parts that build a model, as ``python -m
hybrid_jax.train`` takes them: ``--config configs/zebra_300m_gdn.py --config.train.micro_batch_size=64``."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from ml_collections import ConfigDict

from hybrid_jax.config import load_config_file

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
PREFIX = "--config."


def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """``ap``'s flags, and the ``--config.KEY=VALUE`` overrides among ``argv`` (anything else unknown is an
    error)."""
    args, rest = ap.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith(PREFIX) and "=" in a)]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --config.train.steps=10)")
    return args, [a[len(PREFIX):] for a in rest]


def _value(text: str, old):
    """``text`` as the type of the field's current value ``old``."""
    if isinstance(old, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"not a bool: {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        return type(old)(float(text)) if isinstance(old, float) else int(text)
    if isinstance(old, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def load(path: str | Path, overrides: list[str] = ()) -> ConfigDict:
    """``get_config()`` of ``path`` with each ``KEY=VALUE`` of ``overrides`` set (the key must exist; the value
    takes the field's type). SystemExit names an unknown key."""
    config = load_config_file(path)
    for item in overrides:
        key, text = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p] if p in node else None
            if not isinstance(node, ConfigDict):
                break
        if not isinstance(node, ConfigDict) or leaf not in node:
            raise SystemExit(f"unknown config key '{key}'; the keys are those of hybrid_jax/config.py")
        node[leaf] = _value(text, node[leaf])
    return config
