"""One machine-readable record per benchmark run: what was measured, on what, by which command, from which tree.

    path = record.save("kernels", {"gdn_anchor": {"fwd_ms": 0.74, "fwd_bwd_ms": 2.64}})
    record.load(path)["figures"]["gdn_anchor"]

A record is a JSON object with the keys of :data:`KEYS`:

- ``name``: what was run (the part, or part and a qualifier: ``train_zebra_300m_gdn``);
- ``commit``: ``$BENCH_COMMIT`` if set, else ``git rev-parse HEAD`` of the tree being measured, else ``"unknown"``
  (a copy of the tree may carry no ``.git``, or another commit's: set ``BENCH_COMMIT`` when copying it);
  ``dirty``: whether tracked files differ from that commit (``None`` when not knowable);
- ``command``: the command line, as ``python -m benchmarks PART ...`` (rebuilt from ``sys.argv``);
- ``gpu``: ``{"device_kind", "platform"}`` of the first device. JAX's, unless the process has imported PyTorch
  and started no JAX backend (the reference's side must not start one: it would take the GPU's memory), then
  PyTorch's;
- ``date``: UTC, ISO 8601; ``versions``: jax, jaxlib, and triton, torch, flash-linear-attention where installed;
- ``figures``: the numbers, as the part reports them (a JSON object).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import shlex
import subprocess
import sys
from typing import Any

KEYS = ("name", "commit", "dirty", "command", "gpu", "date", "versions", "figures")
PACKAGES = {"jax": "jax", "jaxlib": "jaxlib", "triton": "triton", "torch": "torch", "fla": "flash-linear-attention"}
REQUIRED_VERSIONS = ("jax", "jaxlib")  # present in every record (None when not installed)
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the tree being measured


def out_dir(explicit: str | os.PathLike | None = None) -> pathlib.Path:
    """Where a part writes its records and side files: ``explicit`` (an ``--out`` flag) if given (a ``.json`` file's
    folder for a record file), else ``$OUT``, else ``bench_out`` in the current directory (created)."""
    path = pathlib.Path(explicit or os.environ.get("OUT") or "bench_out")
    if explicit is not None and path.suffix == ".json":
        path = path.parent
    path.mkdir(parents=True, exist_ok=True)
    return path


def commit() -> tuple[str, bool | None]:
    """The commit of the tree being measured and whether its tracked files differ from it: ``$BENCH_COMMIT`` where
    set (a copy of the tree, as on the GPU machine, may carry a ``.git`` of another commit), else git's."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"], None
    return git_head(ROOT)


def git_head(root: str | os.PathLike) -> tuple[str, bool | None]:
    """The commit checked out at ``root`` and whether its tracked files differ from it (``("unknown", None)`` where
    git cannot say: no checkout there, ``root`` only a folder inside another checkout (an unpacked ``git archive``
    in a checkout's ignored folder), or no git)."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        if pathlib.Path(top).resolve() != pathlib.Path(root).resolve():
            return "unknown", None
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return head, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def command(argv: list[str] | None = None) -> str:
    """``argv`` (default ``sys.argv``) as the ``python -m benchmarks ...`` line that runs it."""
    argv = sys.argv if argv is None else argv
    script = pathlib.Path(argv[0]) if argv else pathlib.Path()
    if script.parent.name == "benchmarks" and script.suffix == ".py":
        part = [] if script.stem == "__main__" else [script.stem]
        return shlex.join(["python", "-m", "benchmarks", *part, *argv[1:]])
    return shlex.join(["python", *argv])


def _jax_started() -> bool:
    """Whether this process has started a JAX backend (importing JAX starts none: the reference's side imports the
    benchmark problems, whose module imports JAX)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def device() -> dict[str, str]:
    """``device_kind`` and ``platform`` of the first device (see the module docstring for which framework)."""
    if "torch" in sys.modules and not _jax_started():
        import torch

        if torch.cuda.is_available():
            return {"device_kind": torch.cuda.get_device_name(), "platform": "rocm" if torch.version.hip else "gpu"}
        return {"device_kind": "cpu", "platform": "cpu"}
    import jax

    d = jax.devices()[0]
    return {"device_kind": d.device_kind, "platform": d.platform}


def versions() -> dict[str, str | None]:
    found = {}
    for key, dist in PACKAGES.items():
        try:
            found[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            if key in REQUIRED_VERSIONS:
                found[key] = None
    return found


def _plain(x: Any) -> Any:
    """JSON for what ``json`` does not know: numpy and JAX scalars and arrays, paths, dataclass-like objects."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    return str(x)


def save(name: str, figures: dict, *, out: str | os.PathLike | None = None) -> pathlib.Path:
    """Write the record of this run (figures ``figures``) to ``out`` (a ``.json`` file, or a directory to hold
    ``<name>.json``), default ``$OUT/<name>.json``; returns its path."""
    head, dirty = commit()
    record = dict(
        name=name,
        commit=head,
        dirty=dirty,
        command=command(),
        gpu=device(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions=versions(),
        figures=figures,
    )
    if out is not None and pathlib.Path(out).suffix == ".json":
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        path = out_dir(out) / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=_plain) + "\n")
    print(f"record: {path}", flush=True)
    return path


def load(path: str | os.PathLike) -> dict:
    """A record written by :func:`save`; ValueError when a key of :data:`KEYS` is missing."""
    record = json.loads(pathlib.Path(path).read_text())
    missing = [k for k in KEYS if k not in record]
    if missing:
        raise ValueError(f"{path}: not a benchmark record, no {missing}")
    return record
