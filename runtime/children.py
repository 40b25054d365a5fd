"""Server processes a command starts and owns (the temporary Prefect server, the vLLM engine): a free port, a
launch that ends with the command even after ``kill -9``, and a stop.

A child is started through :data:`TIED` in a process group of its own: Ctrl-C in a terminal signals the whole
foreground group, and a server must outlive the command's own handling of it rather than stop under it; the
kernel's parent-death signal still ends it when the command dies, however it dies. Which signal is the child's
choice: SIGTERM for a server that must stop children of its own (the vLLM engine's engine core), SIGKILL for one
whose graceful stop only delays its end (the temporary Prefect server: its lifespan shutdown took seconds under load,
and a check 3 s after a ``kill -9`` found it still running in 1 of 24 crash cases, issue 42).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

TIED = """\
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))  # PR_SET_PDEATHSIG: end with the parent
if os.getppid() != int(sys.argv[2]):  # the parent died before the request took effect
    sys.exit(1)
os.execv(sys.argv[3], sys.argv[3:])
"""
"""A ``python -c`` program: ``TIED SIGNAL PARENT_PID EXECUTABLE ARGS...`` becomes ``EXECUTABLE ARGS...``, sent the
signal numbered ``SIGNAL`` when the process ``PARENT_PID`` ends."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_tied(
    python: str,
    argv: Sequence[str],
    *,
    death_signal: signal.Signals = signal.SIGTERM,
    own_group: bool = True,
    **popen: Any,
) -> subprocess.Popen:
    """Start ``argv`` (its executable first) from ``python`` through :data:`TIED`, sent ``death_signal`` when this
    process ends; in a process group of its own unless not ``own_group`` (a training process, which Ctrl-C at the
    terminal stops with its command). The request is made in the child before it runs anything (no ``preexec_fn``,
    which is not safe in a process with threads), and is the calling thread's: call it from a thread that lasts as
    long as the child must (Linux sends the signal when the thread that started the child ends)."""
    tied = [python, "-c", TIED, str(int(death_signal)), str(os.getpid()), *argv]
    return subprocess.Popen(tied, process_group=0 if own_group else None, **popen)


def launch_tied_in_thread(
    python: str,
    argv: Sequence[str],
    *,
    name: str,
    death_signal: signal.Signals = signal.SIGTERM,
    own_group: bool = True,
    **popen: Any,
) -> subprocess.Popen:
    """:func:`launch_tied` from a daemon thread named ``name`` that lives as long as the child (it waits for it), so
    the child ends with this process and not with the thread that asked for it (Linux sends the parent-death signal
    when the *thread* that started the child ends: a task runner's worker thread may end before the child should)."""
    started: dict[str, Any] = {}
    launched = threading.Event()

    def start_and_wait() -> None:
        try:
            process = launch_tied(python, argv, death_signal=death_signal, own_group=own_group, **popen)
        except BaseException as error:  # raised in the caller's thread below
            started["error"] = error
            launched.set()
            return
        started["process"] = process
        launched.set()
        process.wait()

    threading.Thread(target=start_and_wait, name=name, daemon=True).start()
    launched.wait()
    if "error" in started:
        raise started["error"]
    return started["process"]


def stop(process: subprocess.Popen, *, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; nothing for a process that has already ended."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
