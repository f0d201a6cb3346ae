"""A user's tuning file: launch configs measured on their own GPU (``python -m hybrid_jax.tune``), used over the
built-in tables of ``kernels/tuning.py``.

A tuning file is JSON (``FORMAT``)::

    {"format": "hybrid_jax.tuning/1", "device_kind": "AMD Instinct MI300X", "platform": "rocm", "arch": "gfx942",
     "versions": {"jax": ..., "jaxlib": ..., "triton": ...}, "driver": ..., "created": ...,
     "recurrent": [{"op": "kda", "K": 32, "V": 64, "config": {...RecurrentConfig...},
                    "tuned_ms": 0.61, "builtin_ms": 0.74}, ...],
     "attention": [{"head_dim": 64, "config": {...AttentionConfig...}, "tuned_ms": ..., "builtin_ms": ...}]}

``op`` is ``gdn``, ``kda`` or ``gla``; ``K``, ``V`` (``head_dim``) are padded head dims (powers of two >= 16). The
per-user cache holds one file per GPU kind (:func:`cache_path`). Which source the kernels use is chosen once per
process by :func:`use` (``auto``: this GPU's cached file if there is one, else the built-in table; ``builtin``; or
a path); a file made on another GPU kind or with other jax / jaxlib / Triton versions is stale: reported and ignored
whole, never half-used. A shape the file has no entry for takes the built-in table.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Any

import jax

from hybrid_jax.kernels import registry, tuning

FORMAT = "hybrid_jax.tuning/1"
OPS = tuple(name for name, op in registry.OPS.items() if op.recurrent)  # the ops a recurrent entry may name


class TuningFileError(ValueError):
    """A tuning file that cannot be used: malformed, or made for another GPU or other versions."""


@dataclasses.dataclass(frozen=True)
class TuningFile:
    """A parsed tuning file: its path, where it was made, and its entries by ``(op, K, V)`` / head dim."""

    path: Path
    device_kind: str
    versions: dict[str, str | None]
    recurrent: dict[tuple[str, int, int], tuning.RecurrentConfig]
    attention: dict[int, tuning.AttentionConfig]


def versions() -> dict[str, str | None]:
    """The versions a tuning file must match: jax, jaxlib and the ``triton`` package (None where absent)."""
    out = {}
    for name in ("jax", "jaxlib", "triton"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cache_path(device_kind: str | None = None) -> Path:
    """This user's tuning file for a GPU kind (default: the current device's):
    ``$HYBRID_JAX_TUNING_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/hybrid_jax/tuning``, then ``<kind>.json``."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    root = os.environ.get("HYBRID_JAX_TUNING_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid_jax" / "tuning"
    return Path(root) / (re.sub(r"[^A-Za-z0-9._-]+", "_", kind).strip("_") + ".json")


def _from_dict(cls, data: Any, where: str):
    """A config dataclass from its JSON dict (nested ``Launch`` / ``AttentionKernel`` dicts included)."""
    if not isinstance(data, dict):
        raise TuningFileError(f"{where}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise TuningFileError(f"{where}: unknown fields {unknown} (known: {sorted(fields)})")
    values = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            values[name] = _from_dict(type(default), value, f"{where}.{name}")
        elif value is not None and not isinstance(value, type(default) if default is not None else int):
            raise TuningFileError(f"{where}.{name}: {value!r} is not a {type(default).__name__}")
        else:
            values[name] = value
    return cls(**values)


def read(path: str | os.PathLike) -> TuningFile:
    """Parse and check a tuning file; a malformed one is a :class:`TuningFileError` naming the file and the fault."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TuningFileError(f"tuning file {path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TuningFileError(f"tuning file {path}: not a {FORMAT} file (its 'format' is "
                              f"{data.get('format') if isinstance(data, dict) else None!r})")
    for key in ("device_kind", "versions"):
        if key not in data:
            raise TuningFileError(f"tuning file {path}: no {key!r}")
    recurrent, attention = {}, {}
    for i, entry in enumerate(data.get("recurrent", [])):
        where = f"tuning file {path}: recurrent[{i}]"
        if not isinstance(entry, dict) or entry.get("op") not in OPS or not all(
                isinstance(entry.get(d), int) for d in ("K", "V")):
            raise TuningFileError(f"{where}: needs 'op' (one of {OPS}), integer 'K' and 'V', and 'config'")
        recurrent[(entry["op"], entry["K"], entry["V"])] = _from_dict(tuning.RecurrentConfig, entry.get("config"),
                                                                      f"{where}.config")
    for i, entry in enumerate(data.get("attention", [])):
        where = f"tuning file {path}: attention[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("head_dim"), int):
            raise TuningFileError(f"{where}: needs an integer 'head_dim' and 'config'")
        attention[entry["head_dim"]] = _from_dict(tuning.AttentionConfig, entry.get("config"), f"{where}.config")
    return TuningFile(path, str(data["device_kind"]), dict(data["versions"]), recurrent, attention)


def stale_reason(tf: TuningFile, device_kind: str | None = None) -> str | None:
    """Why ``tf`` must not be used on this device with these versions, or None."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    if tf.device_kind != kind:
        return f"made on {tf.device_kind!r}, this device is {kind!r}"
    now = versions()
    diff = [f"{k} {tf.versions.get(k)} -> {now[k]}" for k in now if tf.versions.get(k) != now[k]]
    return f"made with other versions ({', '.join(diff)})" if diff else None


def write(path: str | os.PathLike, *, recurrent: list[dict], attention: list[dict] = (),
          extra: dict | None = None) -> Path:
    """Write a tuning file for the current device: ``recurrent`` entries ``{"op", "K", "V", "config":
    RecurrentConfig, "tuned_ms", "builtin_ms"}``, ``attention`` entries ``{"head_dim", "config": AttentionConfig,
    ...}`` (configs as dataclasses); written to a temporary file first, then renamed (never half-written)."""
    dev = jax.devices()[0]
    data = {"format": FORMAT, "device_kind": dev.device_kind, "platform": dev.platform,
            "arch": tuning.arch_of(dev.device_kind, dev.platform), "versions": versions(),
            "driver": getattr(dev.client, "platform_version", None),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **(extra or {}),
            "recurrent": [dict(e, config=dataclasses.asdict(e["config"])) for e in recurrent],
            "attention": [dict(e, config=dataclasses.asdict(e["config"])) for e in attention]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    read(tmp)  # what is written must read back
    tmp.replace(path)
    return path


@dataclasses.dataclass
class _Active:
    source: str | None = None  # what use() was given; None: not chosen yet
    file: TuningFile | None = None
    description: str = ""


_ACTIVE = _Active()


def use(source: str = "auto") -> str:
    """Choose, for this process, where the kernels' launch configs come from, and say which in one line:
    ``auto`` (this GPU's cached tuning file if there is a usable one, else the built-in table), ``builtin``, or a
    tuning file's path (a malformed or missing one is a :class:`TuningFileError`; a stale one is reported and
    ignored, as with ``auto``)."""
    arch = tuning.current_arch()
    if jax.default_backend() == "cpu":
        builtin = "built-in fallback (on cpu, kernel_impl=auto runs the kernels' XLA form: nothing to tune)"
    else:
        builtin = f"built-in {arch}" if arch != "fallback" else "fallback: run python -m hybrid_jax.tune"
    _ACTIVE.source, _ACTIVE.file, _ACTIVE.description = source, None, builtin
    if source == "builtin":
        return builtin
    if source == "auto":
        path = cache_path()
        if not path.is_file():
            return builtin
        try:
            tf = read(path)
        except TuningFileError as e:
            _ACTIVE.description = f"{builtin} ({e}: ignored)"
            return _ACTIVE.description
    else:
        if not Path(source).is_file():
            raise TuningFileError(f"tuning file {source}: no such file (model.tuning is auto, builtin or a path)")
        tf = read(source)
    reason = stale_reason(tf)
    if reason:
        _ACTIVE.description = f"{builtin} (tuning file {tf.path} is stale, {reason}: ignored; run python -m " \
                              f"hybrid_jax.tune again)"
        return _ACTIVE.description
    _ACTIVE.file, _ACTIVE.description = tf, f"tuning file {tf.path}"
    return _ACTIVE.description


def active() -> TuningFile | None:
    """The tuning file in use (``auto`` is chosen on the first call if :func:`use` was not called), or None."""
    if _ACTIVE.source is None:
        use("auto")
    return _ACTIVE.file


def description() -> str:
    """The one line :func:`use` returned for the source in use."""
    active()
    return _ACTIVE.description


def missing(shapes: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The ``(op, K, V)`` of ``shapes`` (padded head dims) that the tuning file in use has no entry for."""
    tf = active()
    return [] if tf is None else [s for s in shapes if s not in tf.recurrent]
