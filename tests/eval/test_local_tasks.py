"""The bundled task files: HellaSwag's jsonl is cleaned exactly as lm-eval's own hellaswag task cleans it, and a run's
task list is checked against the bundled tasks and their data files."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from hybrid_jax.eval.local_tasks import check_tasks, local_tasks  # noqa: E402
from hybrid_jax.eval.run import task_manager  # noqa: E402

HELLASWAG = [  # the HellaSwag repository's schema; the second row has WikiHow's bracket artifacts
    {"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow covering the "
     "window of a car, and a woman wearing winter clothes smiles.", "ctx_b": "then", "split": "val",
     "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift.",
                 ", the man puts on a christmas coat.", ", the man continues removing the snow on his car."],
     "label": "3"},
    {"ind": 9, "activity_label": "Home and Garden", "ctx_a": "[header] How to clean a grill [title] Heat the grill.",
     "ctx_b": "THE grates get hot  fast", "split": "val", "label": "0",
     "endings": ["[step] Scrub it. [title] Done", "Use a brush [substeps] now", "c", "d"]},
]


def test_hellaswag_is_read_as_lm_eval_reads_it(tmp_path):
    import datasets
    from lm_eval.tasks import get_task_dict

    (tmp_path / "hellaswag_val.jsonl").write_text("".join(json.dumps(d) + "\n" for d in HELLASWAG))
    task = get_task_dict(["hellaswag"], task_manager(["hellaswag"], tmp_path, tmp_path / "tasks"))["hellaswag"]
    ours = [(task.doc_to_text(d), task.doc_to_choice(d), task.doc_to_target(d)) for d in task.validation_docs()]
    utils = Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks" / "hellaswag" / "utils.py"
    spec = importlib.util.spec_from_file_location("lm_eval_hellaswag_utils", utils)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    theirs = [(r["query"], r["choices"], int(r["gold"])) for r in module.process_docs(datasets.Dataset.from_list(
        HELLASWAG))]
    assert ours == theirs
    assert ours[1][0] == "Home and Garden: How to clean a grill. Heat the grill. The grates get hot fast"


def test_check_tasks(tmp_path, monkeypatch):
    assert local_tasks()["piqa"] == ["piqa_validation_with_labels.jsonl"]
    monkeypatch.delenv("HYBRID_JAX_EVAL_DATA", raising=False)
    with pytest.raises(ValueError, match=r"no data folder for piqa: set train.eval_tasks_data \(or "
                                         r"HYBRID_JAX_EVAL_DATA\)"):
        check_tasks(["piqa"], None)
    with pytest.raises(ValueError, match=r"unknown task 'hellaswag_x': did you mean hellaswag\?"):
        check_tasks(["hellaswag_x"], tmp_path)
    with pytest.raises(ValueError, match=r"hellaswag reads hellaswag_val.jsonl from .*, which is not there"):
        check_tasks(["hellaswag"], tmp_path)
    (tmp_path / "hellaswag_val.jsonl").write_text("")
    monkeypatch.setenv("HYBRID_JAX_EVAL_DATA", str(tmp_path))
    assert check_tasks(["hellaswag"], None) == tmp_path.resolve()
