"""Run lm-eval tasks on a checkpoint (JAX model directly) or on an exported HF directory; write the results as JSON.

Local task files (``tasks/*.yaml``, ``dataset_path: json``) are used for the tasks they define when a data directory
is given (``data_dir`` or the ``HYBRID_JAX_EVAL_DATA`` environment variable): ``${DATA_DIR}`` in them is replaced by
that directory. Any other lm-eval task name works when its data is reachable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TASKS_DIR = Path(__file__).with_name("tasks")
DATA_ENV = "HYBRID_JAX_EVAL_DATA"


def local_task_dir(data_dir: str | Path, out: Path) -> Path:
    """Write the local task YAMLs with ``${DATA_DIR}`` filled in into ``out``; returns ``out``."""
    data_dir = Path(data_dir).resolve()
    if not data_dir.is_dir():
        raise FileNotFoundError(f"eval data directory {data_dir} not found")
    out.mkdir(parents=True, exist_ok=True)
    for yaml in TASKS_DIR.glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("${DATA_DIR}", str(data_dir)))
    return out


def task_manager(tasks: list[str], data_dir: str | Path | None, scratch: Path):
    """An lm-eval ``TaskManager`` that knows our local tasks (when there is a data dir) and, if any requested task is
    not local, lm-eval's own."""
    from lm_eval.tasks import TaskManager

    data_dir = data_dir or os.environ.get(DATA_ENV)
    if not data_dir:
        return TaskManager()
    local = {p.stem for p in TASKS_DIR.glob("*.yaml")}
    return TaskManager(include_path=str(local_task_dir(data_dir, scratch)),
                       include_defaults=not set(tasks) <= local)


def evaluate(*, tasks: list[str], workdir: str | Path | None = None, step: int | None = None,
             hf_dir: str | Path | None = None, limit: int | None = None, batch_size: int = 8,
             num_fewshot: int | None = None, data_dir: str | Path | None = None, seed: int = 1234,
             trust_remote_code: bool = False) -> dict:
    """Evaluate the checkpoint of ``workdir`` (JAX) or the export ``hf_dir`` (lm-eval's ``hf`` model on the model
    :func:`hybrid_jax.export.hf_load.load_export` gives: our exports with our own modeling code, another directory's
    code only with ``trust_remote_code``) on ``tasks``. Returns ``{"backend", "step", "tasks", "limit", "results":
    {task: metrics}}`` and writes it as ``WORKDIR/eval/step_<N>_jax.json`` (``HF_DIR/eval_results.json`` for an
    export)."""
    if workdir is None and hf_dir is None:
        raise ValueError("give a workdir (JAX model) or an exported HF directory")
    backend = "hf" if hf_dir else "jax"
    if hf_dir:
        import torch
        from lm_eval.models.huggingface import HFLM
        from transformers import AutoTokenizer

        from hybrid_jax.export.hf import NO_POSITION_LIMIT
        from hybrid_jax.export.hf_load import load_export

        device = "cuda" if torch.cuda.is_available() else "cpu"
        # the exported model computes every position on the fly (recurrent state, RoPE/YaRN angles), so lm-eval's
        # max_length (else read from max_position_embeddings, the training seq_len in older exports) must never make
        # it refuse a long continuation: lm-eval asserts on a continuation longer than max_length
        max_length = max(_export_positions(hf_dir), NO_POSITION_LIMIT)
        hf = load_export(hf_dir, trust_remote_code=trust_remote_code).to(device)
        model = HFLM(pretrained=hf, tokenizer=AutoTokenizer.from_pretrained(hf_dir), batch_size=batch_size,
                     device=device, max_length=max_length)
        model_args = None
    else:
        model, step = _jax_lm(workdir, step, batch_size)
        model_args = None
    out = run_tasks(model, tasks, model_args=model_args, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
                    data_dir=data_dir, seed=seed)
    record = dict(backend=backend, step=step, source=str(hf_dir or workdir), tasks=tasks, limit=limit,
                  num_fewshot=num_fewshot, results=out["results"], n_samples=out.get("n-samples"))
    path = Path(hf_dir) / "eval_results.json" if hf_dir else Path(workdir) / "eval" / f"step_{step}_jax.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    record["path"] = str(path)
    return record


def run_tasks(model, tasks: list[str], *, model_args: dict | None = None, limit: int | None = None,
              num_fewshot: int | None = None, batch_size: int = 8, data_dir: str | Path | None = None,
              seed: int = 1234) -> dict:
    """lm-eval's ``simple_evaluate`` output of ``model`` (an lm-eval ``LM``, or a model name with ``model_args``) on
    ``tasks``, seeded, with the local task files for ``data_dir``."""
    import tempfile

    import lm_eval

    with tempfile.TemporaryDirectory() as scratch:
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=limit,
                                       num_fewshot=num_fewshot, batch_size=batch_size,
                                       task_manager=task_manager(tasks, data_dir, Path(scratch)), random_seed=seed,
                                       numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                       log_samples=False)


def _export_positions(hf_dir: str | Path) -> int:
    """``max_position_embeddings`` of an export's ``config.json`` (0 when it has none)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json: not an export (python -m hybrid_jax.export --out DIR)")
    return int(json.loads(path.read_text()).get("max_position_embeddings") or 0)


def _jax_lm(workdir: str | Path, step: int | None, batch_size: int):
    from hybrid_jax.checkpoints import latest_step, load
    from hybrid_jax.data.run_tokenizer import MOCK_NOTE, run_tokenizer
    from hybrid_jax.data.tokenizer import check_vocab
    from hybrid_jax.eval.lm import HybridJaxLM

    step = latest_step(workdir) if step is None else step
    model, config = load(workdir, step)
    tokenizer = run_tokenizer(config)
    if tokenizer is None:
        raise ValueError(f"{MOCK_NOTE} ({workdir}): there is no text to score it on")
    check_vocab(config.model.vocab_size, tokenizer.vocab_size)
    return HybridJaxLM(model, tokenizer, batch_size=batch_size, max_length=config.train.seq_len), step
