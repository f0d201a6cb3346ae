"""The task files bundled in ``hybrid_jax/eval/tasks`` and the data files each reads: checked before a run that
scores them starts (``train.eval_tasks``), so a misspelt task or a missing file is one line, not a failure at the
first evaluation."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from hybrid_jax.eval.run import DATA_ENV, TASKS_DIR

_DATA_FILE = re.compile(r"\$\{DATA_DIR\}/([^\s'\"]+)")


def local_tasks() -> dict[str, list[str]]:
    """Each bundled task's name -> the files its YAML reads from the data folder (e.g. ``ARC-Easy-test.jsonl``)."""
    return {p.stem: _DATA_FILE.findall(p.read_text()) for p in sorted(TASKS_DIR.glob("*.yaml"))}


def check_tasks(tasks: list[str], data_dir: str | Path | None) -> Path:
    """The data folder for ``tasks`` (``data_dir``, else ``$HYBRID_JAX_EVAL_DATA``) once every task is a bundled one
    and every file it reads is there; a one-line ``ValueError`` saying what to change otherwise."""
    known = local_tasks()
    for task in tasks:
        if task not in known:
            near = difflib.get_close_matches(task, list(known), n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ValueError(f"unknown task {task!r}: {hint}the bundled tasks are {', '.join(known)} "
                             f"({TASKS_DIR}; add a YAML there for another)")
    folder = data_dir or os.environ.get(DATA_ENV)
    if not folder:
        raise ValueError(f"no data folder for {', '.join(tasks)}: set train.eval_tasks_data (or {DATA_ENV}) to the "
                         "folder of their jsonl files")
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise ValueError(f"the task data folder {folder} does not exist")
    for task in tasks:
        missing = [name for name in known[task] if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{task} reads {', '.join(missing)} from {folder}, which is not there")
    return folder
