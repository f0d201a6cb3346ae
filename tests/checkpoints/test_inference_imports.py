"""``hybrid_jax.checkpoints``: inference (load, export, eval, generate, explore) never imports the trainer."""

import ast
import subprocess
import sys

from tests.conftest import REPO

INFERENCE_MODULES = ["hybrid_jax.checkpoints", "hybrid_jax.export.__main__", "hybrid_jax.export.writer",
                     "hybrid_jax.eval.__main__", "hybrid_jax.eval.run", "hybrid_jax.eval.lm", "hybrid_jax.generate",
                     "hybrid_jax.explore"]
INFERENCE_FILES = ["hybrid_jax/checkpoints", "hybrid_jax/generate.py", "hybrid_jax/explore",
                   "hybrid_jax/export", "hybrid_jax/eval"]
# The exception: importing an FLA checkpoint or one of our HF exports writes a training start (with an optimizer
# state), in ``write_training_start`` itself; export, eval, generate and explore never reach it.
WRITES_A_TRAINING_START = {("hybrid_jax/export/imports.py", "write_training_start")}


def _train_imports(path) -> set[tuple[str, str]]:
    """``(file, enclosing function or "")`` of every ``hybrid_jax.train`` import in ``path``, nested ones included."""
    found = set()

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else scope
            names = ([child.module or ""] if isinstance(child, ast.ImportFrom) else
                     [a.name for a in child.names] if isinstance(child, ast.Import) else [])
            if any(n == "hybrid_jax.train" or n.startswith("hybrid_jax.train.") for n in names):
                found.add((str(path.relative_to(REPO)), scope))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_inference_does_not_import_train():
    code = (f"import sys\nimport hybrid_jax\nfor m in {INFERENCE_MODULES!r}: __import__(m)\nhybrid_jax.load\n"
            "print(sorted(m for m in sys.modules if m == 'hybrid_jax.train' or m.startswith('hybrid_jax.train.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"inference imported the trainer: {out.stdout}"
    files = [f for name in INFERENCE_FILES for f in
             ((REPO / name).rglob("*.py") if (REPO / name).is_dir() else [REPO / name])]
    assert len(files) > 10
    found = set().union(*(_train_imports(f) for f in files))
    assert found == WRITES_A_TRAINING_START, found
