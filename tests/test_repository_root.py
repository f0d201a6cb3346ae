"""Run from the repository root, as a user does: the top-level ``kernels/`` folder must never shadow the PyPI package
``kernels`` that transformers imports (it did, and loading an export there failed with ``cannot import name
'CUDAProperties' from 'kernels'``). A trained run is exported with the command and loaded with transformers."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("torch")
pytest.importorskip("transformers")

LOAD = """
import sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
import hybrid_jax

import pathlib
import kernels
top_level = (pathlib.Path(sys.argv[3]) / "kernels").resolve()  # the repository's folder (a .venv may sit beside it)
assert "hybrid_jax" not in (getattr(kernels, "__file__", None) or "") and all(
    pathlib.Path(p).resolve() != top_level for p in kernels.__path__), kernels.__path__
hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
model, config = hybrid_jax.load(sys.argv[2])
tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (1, 12), dtype=np.int32)
with torch.no_grad():
    theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
np.testing.assert_allclose(theirs, np.asarray(model(tokens)), rtol=2e-4, atol=2e-4)
print("loaded and equal")
"""


def test_an_export_loads_with_transformers_from_the_repository_root(finished_run, tmp_path):
    export = subprocess.run([sys.executable, "-m", "hybrid_jax.export", "--workdir", str(finished_run), "--out",
                             str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    load = subprocess.run([sys.executable, "-", str(tmp_path / "hf"), str(finished_run), str(REPO)], input=LOAD,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert load.returncode == 0 and "loaded and equal" in load.stdout, load.stderr[-3000:]

