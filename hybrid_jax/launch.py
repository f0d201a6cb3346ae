"""Multi-process start-up: who am I, how many are we, where is the coordinator. No JAX distributed API for users.

One process per GPU. Each process works out ``jax.distributed.initialize``'s four arguments from its
environment (:func:`distributed_args`), first match wins:

1. Explicit (set by ``python -m hybrid_jax.launch`` or by hand): ``JAX_COORDINATOR_ADDRESS`` (``host:port``),
   ``HYBRID_JAX_NUM_PROCESSES``, ``HYBRID_JAX_PROCESS_ID``, optional ``JAX_LOCAL_DEVICE_IDS`` (``"0"`` or ``"0,1"``).
2. SLURM (inside ``srun`` with more than one task): ``SLURM_NTASKS`` processes, id ``SLURM_PROCID``, coordinator
   the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) on port ``JAX_COORDINATOR_PORT``
   (default :data:`DEFAULT_PORT`), local GPU ``SLURM_LOCALID``, or GPU 0 when SLURM already left exactly one GPU
   visible to the task (``--gpus-per-task=1`` sets ``CUDA_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES``).
3. Otherwise a single process: nothing to initialise.

The local launcher, ``python -m hybrid_jax.launch --nproc N [--port P] -- COMMAND ...``, starts ``N`` copies of
``COMMAND`` on this machine with the explicit variables set (process ``i`` on GPU ``i``), waits for all of them,
and stops the others as soon as one fails. On CPU (``--cpu``) it sets no device ids.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

DEFAULT_PORT = 61999  # above Linux's ephemeral range (32768-60999): no outgoing connection holds it
GPU_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


@dataclass(frozen=True)
class DistributedArgs:
    """The keyword arguments of ``jax.distributed.initialize`` for this process."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names: ``"gpu[01-02,05],login1"`` -> ``gpu01 gpu02 gpu05 login1``.

    Zero padding is kept; several bracket groups in one name (``"r[1-2]n[1-2]"``) expand as a product.
    """
    hosts: list[str] = []
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        match = re.search(r"\[([^\]]*)\]", name)
        if match is None:
            hosts.append(name)
            continue
        head, tail = name[: match.start()], name[match.end() :]
        for part in match.group(1).split(","):
            first, _, last = part.partition("-")
            numbers = range(int(first), int(last or first) + 1)
            hosts.extend(host for n in numbers for host in expand_nodelist(f"{head}{n:0{len(first)}d}{tail}"))
    return hosts


def local_device_ids(local_rank: int, env: Mapping[str, str]) -> tuple[int, ...]:
    """The GPU of local process ``local_rank``: itself when every GPU is visible, 0 when SLURM left it just one."""
    for var in GPU_VISIBILITY_VARS:
        if env.get(var) and len(env[var].split(",")) == 1:
            return (0,)
    return (local_rank,)


def slurm_args(env: Mapping[str, str]) -> DistributedArgs | None:
    """:class:`DistributedArgs` from a SLURM step's variables, or None outside a multi-task step."""
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if tasks <= 1 or not nodelist or "SLURM_PROCID" not in env:
        return None
    port = int(env.get("JAX_COORDINATOR_PORT") or DEFAULT_PORT)
    return DistributedArgs(
        coordinator_address=f"{expand_nodelist(nodelist)[0]}:{port}",
        num_processes=tasks,
        process_id=int(env["SLURM_PROCID"]),
        local_device_ids=local_device_ids(int(env.get("SLURM_LOCALID", 0)), env),
    )


def explicit_args(env: Mapping[str, str]) -> DistributedArgs | None:
    """:class:`DistributedArgs` from ``JAX_COORDINATOR_ADDRESS`` and ``HYBRID_JAX_NUM_PROCESSES/PROCESS_ID``."""
    if "JAX_COORDINATOR_ADDRESS" not in env or "HYBRID_JAX_NUM_PROCESSES" not in env:
        return None
    ids = env.get("JAX_LOCAL_DEVICE_IDS")
    return DistributedArgs(
        coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(env["HYBRID_JAX_NUM_PROCESSES"]),
        process_id=int(env["HYBRID_JAX_PROCESS_ID"]),
        local_device_ids=tuple(int(i) for i in ids.split(",")) if ids else None,
    )


def distributed_args(env: Mapping[str, str] | None = None) -> DistributedArgs | None:
    """This process's arguments (explicit variables first, then SLURM), or None for a single process."""
    env = os.environ if env is None else env
    return explicit_args(env) or slurm_args(env)


def initialize(env: Mapping[str, str] | None = None) -> DistributedArgs | None:
    """``jax.distributed.initialize(...)`` with :func:`distributed_args` when there are several processes.

    Call it before anything touches a device. Returns the arguments used, or None for a single process.
    """
    args = distributed_args(env)
    if args is not None and args.num_processes > 1:
        import jax

        jax.distributed.initialize(**asdict(args))
    return args


# --------------------------------------------------------------------------------------------- local launcher
def free_port() -> int:
    """A TCP port that is free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(rank: int, nproc: int, port: int, *, cpu: bool, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of local process ``rank`` of ``nproc`` (coordinator on 127.0.0.1:``port``)."""
    env = dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", HYBRID_JAX_NUM_PROCESSES=str(nproc),
               HYBRID_JAX_PROCESS_ID=str(rank))
    env.pop("JAX_LOCAL_DEVICE_IDS", None)
    if not cpu:
        env["JAX_LOCAL_DEVICE_IDS"] = str(rank)
    return env


def launch(command: Sequence[str], nproc: int, *, port: int | None = None, cpu: bool = False) -> int:
    """Run ``nproc`` copies of ``command`` as one distributed job on this machine; the first failure's exit code."""
    if nproc == 1:
        return subprocess.call(list(command))
    port = port or free_port()
    procs = [subprocess.Popen(list(command), env=process_env(r, nproc, port, cpu=cpu, base=os.environ))
             for r in range(nproc)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_jax.launch",
        description="Start N processes of COMMAND on this machine as one JAX job (process i on GPU i).",
        epilog="example: python -m hybrid_jax.launch --nproc 8 -- python -m hybrid_jax.train --config configs/X.py",
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes (one per GPU)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes: set no device ids")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.nproc < 1:
        parser.error("need --nproc >= 1 and a command after --")
    return launch(command, args.nproc, port=args.port, cpu=args.cpu)


if __name__ == "__main__":
    sys.exit(main())
