"""The fault-injection suite: every fault an outside reliability test found (issue "Nothing lost, nothing run
unasked"), reproduced on CPU with the tiny trainer, and the kill -9 / signal cases that hold, so they stay held.
Most tests damage a copy of the shared finished run (``run_copy``, tests/conftest.py)."""

from pathlib import Path

from tests.train.common import run_config

__all__ = ["run_config", "snapshot"]


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder``: its size and content (to show that a refusal changed nothing)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}
