"""A server a command starts ends with the command, ``kill -9`` included (runtime/children.py): with the signal it
was tied to, so one that takes its time over SIGTERM (or ignores it) is still gone at once when tied to SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import running

ROOT = Path(__file__).resolve().parents[2]
COMMAND = """
import signal, sys, time
from runtime.children import launch_tied
SLOW_TO_STOP = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
child = launch_tied(sys.executable, [sys.executable, "-c", SLOW_TO_STOP], death_signal=signal.Signals[sys.argv[1]])
print(child.pid, flush=True)
time.sleep(600)
"""
"""A command that starts a server ignoring SIGTERM (a graceful stop that never ends), tied to the signal named by its
argument, prints the server's pid and waits to be killed."""


def _server_after_kill_minus_nine_of_its_command(death_signal: str) -> tuple[int, bool]:
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND, death_signal], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    server = int(command.stdout.readline())
    deadline = time.monotonic() + 60
    while not running(server) or "python" not in Path(f"/proc/{server}/cmdline").read_text():
        assert time.monotonic() < deadline, "the server never started"
        time.sleep(0.05)
    time.sleep(1.0)  # past the exec: the signal request is the launcher's, kept across it
    os.kill(command.pid, signal.SIGKILL)
    command.wait(timeout=30)
    time.sleep(1.0)
    return server, running(server)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_issue42_a_server_tied_to_sigkill_is_gone_within_a_second_of_its_commands_kill_minus_nine():
    server, running = _server_after_kill_minus_nine_of_its_command("SIGKILL")
    assert not running, "a server tied to SIGKILL outlived its command"
    server, running = _server_after_kill_minus_nine_of_its_command("SIGTERM")
    try:
        assert running, "tied to SIGTERM, a server that ignores it lives on: why the Prefect server is tied to SIGKILL"
    finally:
        os.kill(server, signal.SIGKILL)
