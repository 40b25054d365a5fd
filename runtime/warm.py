"""A training process of its own, started warm: forked from a server that has already imported the worker's code.

With ``execution.own_process`` (``sampling.staleness`` >= 1) every update trains in a process of its own
(:mod:`runtime.launch`). A fresh ``python -m runtime.worker`` pays for importing torch, transformers, accelerate
and peft each time: about 10 s on a 2-core CPU, as long as a small model's whole update (bench/RESULTS.md,
"Overlapped iterations"). So a command starts one server (``python -m runtime.warm``) the first time a stage needs
such a process; the server imports :data:`PRELOAD` once, and each job is a ``fork`` of it, running
:func:`runtime.worker.main` as the fresh process would.

Choices:
1. A job is the same as in a fresh process: it takes the requester's current environment and working directory
   whole (a test's variables, the stage's ``OMP_NUM_THREADS`` and bar file), its own log as stdout and stderr, and
   its torch threads; it runs :func:`runtime.worker.main` on its spec and leaves with :func:`os._exit`. The server
   imports modules and runs no torch operation, so the fork inherits no thread pool and no CUDA context (CUDA
   starts in the job, as in a fresh process).
2. Nothing outlives the command: the server ends at the command's end (its requests closed) or with the command
   (the parent-death signal, asked for by a thread that lives as long as the server: Linux sends it when the
   *thread* that started the child ends), and a job is ended with the server (SIGKILL, checked against the
   server's pid after it was asked for). A ``kill -9`` of the command ends the job, as it ended the fresh process.
3. One job at a time per command (the overlapped update is one stage); a second requester waits. A server that
   died is started again for the next job; its job's exit status is its signal's, as a fresh process's would be.
4. A fork copies only the thread that forks: a lock another thread held at that moment stays held in the child for
   ever. So the server forks only while it is its process's one thread and no CUDA context exists
   (:func:`_unforkable`); otherwise its job is a fresh ``python -m runtime.worker``, as without the server, and the
   server says why once. That is why :data:`PRELOAD` stops short of MLflow, polars and pyarrow: importing them
   starts threads (jemalloc's background threads, polars' out-of-core cleaner), so a job imports them itself (about
   2 s of the 9 s a fresh process spends importing, issue 42). The server itself is started without a
   ``preexec_fn`` (not safe in the command, which has threads): through :func:`runtime.children.launch_tied`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO

from runtime.children import launch_tied, launch_tied_in_thread

PRELOAD = ("runtime.worker", "rlhf_core.loading", "rlhf_core.models", "transformers", "peft", "prefect")
"""What the server imports once: the worker, and the libraries the training stages' models need, none of which starts
a thread (choice 4); the stages' own modules, MLflow, polars and pyarrow are the job's to import."""
SERVER = [sys.executable, "-m", "runtime.warm"]
"""The server's command line."""
READY = "ready"
POLL_SECONDS = 0.5
"""How often the requester looks for the job's end, showing the job's bar between (:func:`run`)."""
PR_SET_PDEATHSIG = 1
STOP_SECONDS = 10.0
"""How long a command's end waits for its server to end by itself before killing it."""

_lock = threading.Lock()
_server: subprocess.Popen | None = None
_ready = False
"""Whether ``_server`` has said it finished its imports."""


def run(spec: str, *, log: str, environment: dict[str, str], relay: Callable[[bool], None]) -> int:
    """Run ``runtime.worker SPEC`` in a warm process, with ``environment`` (its ``OMP_NUM_THREADS`` the torch
    threads) and its output in ``log``; call ``relay(False)`` while it runs and ``relay(True)`` at its end. Returns
    its exit status (negative: the signal that ended it), as :class:`subprocess.Popen` would."""
    request = {"spec": spec, "log": log, "environment": environment, "cwd": os.getcwd()}
    with _lock:
        server = _running_server()
        assert server.stdin is not None and server.stdout is not None
        try:
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
        except BrokenPipeError:
            return _ended(server)
        status = _wait_for_status(server.stdout, relay)
        return _ended(server) if status is None else status


def _wait_for_status(replies: IO[str], relay: Callable[[bool], None]) -> int | None:
    """The job's exit status, read from the server's next reply (None if the server ended first)."""
    while not select.select([replies], [], [], POLL_SECONDS)[0]:
        relay(False)
    relay(True)
    line = replies.readline()
    return int(json.loads(line)["status"]) if line else None


def _ended(server: subprocess.Popen) -> int:
    """A server that ended during a job: its status stands for the job's (a kill of the server killed the job)."""
    global _server
    status = server.wait()
    _server = None
    return status if status != 0 else -signal.SIGKILL


def prepare() -> None:
    """Start the command's server now, if none runs, without waiting for its imports: a campaign that will train in
    processes of its own calls it first, so the imports run while its first stages do."""
    with _lock:
        _start()


def _start() -> subprocess.Popen:
    """The command's server: the one running, or a new one (its imports maybe not done yet)."""
    global _server, _ready
    if _server is not None and _server.poll() is None:
        return _server
    server = launch_tied_in_thread(  # choice 2: started from a thread that lives as long as the server
        sys.executable,
        SERVER,
        name="rlhf-warm-server",
        own_group=False,  # Ctrl-C at the terminal reaches the server and its job, as a fresh process
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _server, _ready = server, False
    atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    """At the command's end: close the server's requests, so that it ends, and wait for it. Its CPU time, and its
    jobs', then count as the command's (``RUSAGE_CHILDREN``), as a fresh training process's did."""
    if server.poll() is not None:
        return
    with contextlib.suppress(OSError):
        server.stdin.close()
    try:
        server.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _running_server() -> subprocess.Popen:
    """The command's server, its imports done."""
    global _ready
    server = _start()
    if not _ready:
        assert server.stdout is not None
        if server.stdout.readline().strip() != READY:
            server.kill()
            raise RuntimeError(f"the warm training server did not start (exit status {server.wait()})")
        _ready = True
    return server


def serve() -> None:
    """The server (``python -m runtime.warm``): import :data:`PRELOAD`, then fork one job per request line."""
    for module in PRELOAD:
        importlib.import_module(module)
    _reply(READY)
    said = False
    for line in sys.stdin:
        request = json.loads(line)
        if (reason := _unforkable()) is None:
            status = _forked(request)
        else:
            if not said:
                sys.stderr.write(f"runtime.warm: {reason}: each job starts as a fresh process\n")
                sys.stderr.flush()
                said = True
            status = _spawned(request)
        _reply(json.dumps({"status": status}))


def _unforkable() -> str | None:
    """Why a fork of this process now would not be safe (choice 4), or None: another thread, or a CUDA context."""
    tasks = Path("/proc/self/task")
    if tasks.is_dir():
        names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    else:  # no /proc: the threads Python knows of
        names = [thread.name for thread in threading.enumerate()]
    if len(names) > 1:
        return f"the warm server has {len(names)} threads ({', '.join(sorted(names))})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the warm server has a CUDA context"
    return None


def _forked(request: dict) -> int:
    """Run the request's job in a fork of this server; its exit status."""
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        _job(request, server)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _spawned(request: dict) -> int:
    """Run the request's job as a fresh ``python -m runtime.worker``, ended with this server; its exit status."""
    with open(request["log"], "wb") as log:
        worker = launch_tied(
            sys.executable,
            [sys.executable, "-m", "runtime.worker", request["spec"]],
            death_signal=signal.SIGKILL,
            own_group=False,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=request["environment"],
            cwd=request["cwd"],
        )
        return worker.wait()


def _reply(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _job(request: dict, server: int) -> None:  # pragma: no cover - runs in the forked job, which never returns
    """The forked job (choice 1): ended with the server, its own log, environment and threads; then the worker."""
    code = 1
    try:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux: no such signal
            pass
        if os.getppid() != server:  # the server ended before the request took effect
            os._exit(1)
        with open(request["log"], "wb") as log, open(os.devnull, "rb") as nothing:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            os.dup2(nothing.fileno(), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["environment"])
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        sys.path[:0] = [path for path in paths if path and path not in sys.path]  # as a fresh process's
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        from runtime.worker import main

        main([request["spec"]])
        code = 0
    except BaseException:  # the worker wrote its own error file; the traceback goes to the log as well
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    serve()
