"""Launch logic: SLURM / explicit environment -> jax.distributed arguments, and a real 2-process CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_jax import launch

REPO = Path(__file__).resolve().parents[1]


def slurm_env(procid: int, *, tasks_per_node: int = 4, nodes: int = 2, **extra: str) -> dict[str, str]:
    """What ``srun`` sets for task ``procid`` of a 2 nodes x 4 GPUs step (one task per GPU)."""
    return dict(
        SLURM_JOB_ID="4242",
        SLURM_NTASKS=str(nodes * tasks_per_node),
        SLURM_STEP_NUM_TASKS=str(nodes * tasks_per_node),
        SLURM_NNODES=str(nodes),
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(procid % tasks_per_node),
        SLURM_NODEID=str(procid // tasks_per_node),
        SLURM_JOB_NODELIST="gpu[01-02]",
        SLURM_STEP_NODELIST="gpu[01-02]",
        **extra,
    )


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-02]", ["gpu01", "gpu02"]),
        ("node7", ["node7"]),
        ("a1,b2", ["a1", "b2"]),
        ("gpu[01-02,05],login1", ["gpu01", "gpu02", "gpu05", "login1"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("mi300x-[9-10]-ib", ["mi300x-9-ib", "mi300x-10-ib"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]):
    assert launch.expand_nodelist(nodelist) == hosts


def test_slurm_two_nodes_by_four_gpus():
    for procid in range(8):
        args = launch.distributed_args(slurm_env(procid))
        assert args == launch.DistributedArgs(
            coordinator_address=f"gpu01:{launch.DEFAULT_PORT}",
            num_processes=8,
            process_id=procid,
            local_device_ids=(procid % 4,),
        )
    # the step's node list wins over the job's, and the port can be overridden
    env = slurm_env(5, JAX_COORDINATOR_PORT="23456")
    env["SLURM_STEP_NODELIST"] = "gpu[07-08]"
    assert launch.distributed_args(env).coordinator_address == "gpu07:23456"


@pytest.mark.parametrize("var", launch.GPU_VISIBILITY_VARS)
def test_slurm_bound_gpu_is_device_zero(var: str):
    """With ``--gpus-per-task=1`` SLURM leaves one GPU visible per task: that GPU is the task's device 0."""
    assert launch.distributed_args(slurm_env(6, **{var: "2"})).local_device_ids == (0,)
    assert launch.distributed_args(slurm_env(6, **{var: "0,1,2,3"})).local_device_ids == (2,)


def test_single_process_needs_no_initialisation():
    assert launch.distributed_args({}) is None
    assert launch.distributed_args(dict(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_STEP_NODELIST="gpu01")) is None
    assert launch.initialize({}) is None  # and does not touch jax.distributed


def test_initialize_passes_the_arguments_to_jax(monkeypatch: pytest.MonkeyPatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    for key, value in slurm_env(6).items():
        monkeypatch.setenv(key, value)
    from hybrid_jax.train.step.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()  # what the trainer calls first
    assert calls == [dict(coordinator_address=f"gpu01:{launch.DEFAULT_PORT}", num_processes=8, process_id=6,
                          local_device_ids=(2,))]


def test_explicit_variables_win_over_slurm():
    env = launch.process_env(1, 2, 1234, cpu=False, base=slurm_env(3))
    assert launch.distributed_args(env) == launch.DistributedArgs("127.0.0.1:1234", 2, 1, (1,))
    env = launch.process_env(0, 2, 1234, cpu=True, base=dict(JAX_LOCAL_DEVICE_IDS="3"))
    assert launch.distributed_args(env) == launch.DistributedArgs("127.0.0.1:1234", 2, 0, None)


def test_launcher_reports_the_first_failure():
    code = "import os, sys; sys.exit(3 if os.environ['HYBRID_JAX_PROCESS_ID'] == '1' else 0)"
    assert launch.main(["--nproc", "2", "--cpu", "--", sys.executable, "-c", code]) == 3
    assert launch.main(["--nproc", "2", "--cpu", "--", sys.executable, "-c", "pass"]) == 0


GATHER = """
import json, sys
from hybrid_jax.launch import initialize
initialize()
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
ids = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))
json.dump(dict(count=jax.process_count(), devices=jax.device_count(), ids=ids.ravel().tolist()),
          open(f"{sys.argv[1]}/{jax.process_index()}.json", "w"))
"""


def test_launcher_starts_a_two_process_jax_job(tmp_path: Path):
    """``python -m hybrid_jax.launch --nproc 2``: both processes join one jax.distributed job and all-gather."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    done = subprocess.run([sys.executable, "-m", "hybrid_jax.launch", "--nproc", "2", "--cpu", "--", sys.executable,
                           "-c", GATHER, str(tmp_path)], cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == dict(count=2, devices=2, ids=[10, 11])


def _losses(workdir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HYBRID_JAX_MULTIPROCESS_TEST") != "1",
                    reason="about 100 CPU-seconds of compiling; run with HYBRID_JAX_MULTIPROCESS_TEST=1")
def test_two_cpu_processes_train_like_one(tmp_path: Path):
    """The demo config, global batch 16: 2 processes x 1 CPU device (jax.distributed over 127.0.0.1, gloo) give
    the same losses as 1 process x 2 devices."""
    train = [sys.executable, "-m", "hybrid_jax.train", "--config", str(REPO / "configs" / "demo.py"),
             "--config.train.steps=3", "--config.train.warmup_steps=1", "--config.train.micro_batch_size=8",
             "--config.train.log_every=1", "--config.train.save_every=1000"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    one = subprocess.Popen([*train, f"--config.train.workdir={tmp_path / 'one'}"], cwd=REPO,
                           env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    two = subprocess.Popen([sys.executable, "-m", "hybrid_jax.launch", "--nproc", "2", "--cpu", "--", *train,
                            f"--config.train.workdir={tmp_path / 'two'}"], cwd=REPO,
                           env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    assert one.wait(timeout=600) == 0
    assert two.wait(timeout=600) == 0
    single, multi = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(single) == len(multi) == 3
    assert multi == pytest.approx(single, rel=1e-5)
    assert single[-1] < single[0]  # it trains
