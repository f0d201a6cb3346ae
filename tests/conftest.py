"""Test-wide settings: 8 host CPU devices (for data-parallel tests), shared helpers and data paths."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The suite compiles far more than it runs (tiny shapes): LLVM's CPU code generation without its expensive passes
# compiles about a third faster. Every comparison stays within one compile setting.
for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

# the kernels read a user's tuning file from this cache (kernels/tuning_file.py): the tests start from none
os.environ["HYBRID_JAX_TUNING_DIR"] = tempfile.mkdtemp(prefix="hybrid_jax_tuning_")

# One persistent compilation cache per test session, shared by the xdist workers and the CLI subprocesses they
# start: many tests compile the same tiny train step or kernel (a cache hit is the same executable), and a fresh
# folder per session keeps every run from a clean start.
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"hybrid_jax_jit_{_run}")
                      if _run else tempfile.mkdtemp(prefix="hybrid_jax_jit_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared development data folder (FineWeb sample, tokenizers, eval files); skips when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def load_config(name: str):
    """``configs/<name>.py``'s ``get_config()``."""
    from hybrid_jax.config import load_config_file

    return load_config_file(REPO / "configs" / f"{name}.py")


def rel_err(a, b) -> float:
    """Relative RMS error ``||a - b|| / ||b||`` (``kernels/tooling/errors.py::rel_rms``, imported when first used)."""
    from hybrid_jax.kernels.tooling.errors import rel_rms

    return rel_rms(a, b)


def jaxpr_equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (a closed jaxpr's included)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from jaxpr_equations(sub)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """A finished run of ``tests/train/common.py::run_config``: checkpoints 10, 15, 20; metrics every 5 steps.
    Read it, or damage a copy (``run_copy``)."""
    from hybrid_jax.train.loop import train
    from tests.train.common import run_config

    workdir = tmp_path_factory.mktemp("finished")
    train(run_config(workdir), log=lambda *_: None)
    return workdir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    """A copy of ``finished_run``'s workdir, to damage or resume."""
    import shutil

    return Path(shutil.copytree(finished_run, tmp_path / "run"))
