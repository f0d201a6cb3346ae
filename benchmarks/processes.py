"""Benchmark commands in processes of their own (JAX and PyTorch each take the GPU's memory, so one process per
part or figure), one after the other."""

from __future__ import annotations

import os
import subprocess


def run_process(cmd: list[str], *, timeout: float | None, cwd: str | os.PathLike | None = None,
                env: dict[str, str] | None = None, quiet: bool = False) -> int | str:
    """Run ``cmd`` to its end: its exit status, or ``"past its N s"`` when it ran past ``timeout`` seconds (it is
    then killed). ``quiet``: its standard output discarded (its errors still shown)."""
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout,
                              stdout=subprocess.DEVNULL if quiet else None).returncode
    except subprocess.TimeoutExpired:
        return f"past its {timeout:.0f} s"
