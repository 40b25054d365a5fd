"""The campaign lock: exclusive, dropped by the kernel when its holder dies, never opened through a link."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.locks import LockHeld, LockTimeout, UnsafeLockFile, exclusive_lock, lock_holder, refuse_if_locked

HOLD = """
import sys, time
from pathlib import Path
from storage.locks import exclusive_lock
with exclusive_lock(Path(sys.argv[1])):
    Path(sys.argv[2]).write_text("held")
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """A subprocess holding the lock on ``tmp_path/.lock`` until killed."""
    lock, ready = tmp_path / ".lock", tmp_path / "ready"
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(ready)], cwd=root)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline, "the holder did not take the lock"
        time.sleep(0.05)
    yield lock, process
    process.kill()
    process.wait()


def test_a_held_lock_names_its_holder_and_is_free_once_the_holder_is_killed(holder):
    lock, process = holder
    assert lock_holder(lock) == process.pid
    with pytest.raises(LockHeld, match=rf"campaign `x` is being run by process {process.pid}"):
        refuse_if_locked(lock, what="campaign `x`")
    with pytest.raises(LockTimeout):
        with exclusive_lock(lock, timeout=0.2, poll_seconds=0.05):
            pass
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert lock_holder(lock) is None
    with exclusive_lock(lock, timeout=0):
        assert lock_holder(lock) == os.getpid()  # flock locks belong to an open file, so this holds too
    refuse_if_locked(lock, what="campaign `x`")


def test_a_missing_lock_is_free_and_not_created(tmp_path: Path):
    assert lock_holder(tmp_path / "no" / ".lock") is None
    assert not (tmp_path / "no").exists()


def test_issue14_a_symbolic_link_at_the_lock_is_refused_and_its_target_untouched(tmp_path: Path):
    target = tmp_path / "precious.txt"
    target.write_text("do not truncate me")
    lock = tmp_path / ".lock"
    lock.symlink_to(target)
    with pytest.raises(UnsafeLockFile, match="symbolic link"):
        with exclusive_lock(lock):
            pass
    with pytest.raises(UnsafeLockFile, match="symbolic link"):
        lock_holder(lock)
    assert target.read_text() == "do not truncate me"


def test_issue14_a_hard_link_at_the_lock_is_refused_and_its_other_name_untouched(tmp_path: Path):
    target = tmp_path / "precious.txt"
    target.write_text("do not truncate me")
    os.link(target, tmp_path / ".lock")
    with pytest.raises(UnsafeLockFile, match="single name"):
        with exclusive_lock(tmp_path / ".lock"):
            pass
    assert target.read_text() == "do not truncate me"
