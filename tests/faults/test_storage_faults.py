"""Storage faults outside the checkpoint folder: a full disk, a workdir that cannot be written, a planted link; each
one line, nothing left behind. A save onto a full disk ends in one line, without Orbax's thread tracebacks."""

import errno
import os
import subprocess
import sys

import pytest

from hybrid_jax.checkpoints import StorageError, WorkdirLock, layout
from hybrid_jax.checkpoints.storage import check_writable
from hybrid_jax.train.loop import train
from tests.conftest import REPO
from tests.faults.conftest import run_config


def test_a_full_disk_when_taking_the_lock_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch):
    """Item 6: a full disk at start was 117 lines from the lock and left an empty ``train.lock``."""
    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(StorageError) as e:
        WorkdirLock(tmp_path).acquire()
    assert str(e.value) == (f"the workdir's lock {tmp_path / layout.LOCK} is full (no space left on the device); "
                            "free space or fix its permissions, or set train.workdir to another folder; the run can "
                            "then be resumed")
    assert not (tmp_path / layout.LOCK).exists()


@pytest.mark.parametrize("fault", ["not a folder", "not writable"])
def test_a_workdir_that_cannot_be_written_is_one_line_before_anything_is_built(tmp_path, fault):
    """Item 6: an unwritable workdir (17-114 lines) or a read-only mount (114)."""
    if fault == "not a folder":
        (tmp_path / "file").write_text("")
        workdir, cause = tmp_path / "file" / "run", "is not a folder"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        parent = tmp_path / "ro"
        parent.mkdir(mode=0o555)
        workdir, cause = parent / "run", "is not writable"
    with pytest.raises(StorageError) as e:
        train(run_config(workdir), log=lambda *_: None)
    assert str(e.value).startswith(f"workdir {workdir} {cause}; free space") and "\n" not in str(e.value)


def test_the_write_probe_never_follows_a_planted_link(tmp_path):
    """Item 11: ``checkpoints/.write-probe-PID`` followed symlinks (a planted link overwrote a file with NULs)."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (folder / f".write-probe-{pid}").symlink_to(victim)
    check_writable(folder)
    assert victim.read_text() == "precious"


def test_a_save_onto_a_full_disk_ends_in_one_line(tmp_path):
    """Item 6: a save onto a full disk ended with the right line after 548 lines of Orbax thread tracebacks. The
    disk is full to the trainer as a file-size limit (``RLIMIT_FSIZE``): the checkpoint's array file cannot grow."""
    overrides = {"train.steps": 2, "train.save_every": 1, "train.log_every": 1, "train.workdir": str(tmp_path / "run"),
                 "model.pattern": "*-G-", "model.num_layers": 4, "model.hidden_size": 32, "model.ffn_size": 64,
                 "train.global_batch_size": 16, "train.micro_batch_size": 2, "train.seq_len": 32}
    limited = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "  # EFBIG, no kill
               "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)); sys.argv[0] = 'hybrid_jax.train'; "
               "runpy.run_module('hybrid_jax.train', run_name='__main__', alter_sys=True)")
    cmd = [sys.executable, "-c", limited, "--config", str(REPO / "configs" / "demo.py"),
           *(f"--config.{k}={v}" for k, v in overrides.items())]
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("error: saving the checkpoint of step 1: checkpoint folder ") and \
        "is full (the file size limit was reached); free space" in errors[0], errors
