"""benchmarks/shapes.py: the reference side (a PyTorch process) imports the benchmark problems without starting a JAX
backend, which would take the GPU's memory; the records it writes then name PyTorch's device."""

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = """
import sys
from benchmarks import record
from benchmarks.shapes import ATTENTION_SHAPES, SHAPES
from jax._src import xla_bridge
assert SHAPES and ATTENTION_SHAPES and not xla_bridge.backends_are_initialized()
sys.modules["torch"] = type(sys)("torch")  # a PyTorch process: record.device() must not start JAX to ask
sys.modules["torch"].cuda = type("cuda", (), {"is_available": staticmethod(lambda: False)})
assert record.device() == {"device_kind": "cpu", "platform": "cpu"}
assert not xla_bridge.backends_are_initialized()
"""


def test_importing_the_problems_starts_no_jax_backend():
    subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, check=True, timeout=120)
