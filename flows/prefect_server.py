"""A temporary Prefect server owned by the command that needs one, and gone when the command is.

Without ``PREFECT_API_URL``, Prefect starts a temporary server itself, in a subprocess
(``prefect.server.api.server.SubprocessASGIServer``) that it stops from an ``atexit`` hook. A
``kill -9`` of the command runs no hook, so that server lived on, an orphan holding its port.

Choices:

1. The command starts the same server (uvicorn serving ``prefect.server.api.server:create_app``, with
   the environment Prefect gives its own) before any flow runs, and points Prefect at it through
   ``PREFECT_API_URL``, so Prefect never starts one of its own. It launches it first
   (:func:`start_prefect_api`) and waits for it last (:func:`ensure_prefect_api`), so the server's
   seconds of starting pass while the command imports torch and checks its inputs.
2. Its concurrency-slot leases are kept on disk, so they outlive it (see :func:`_launch`).
3. The server is started through a two-line launcher that asks the kernel to send it SIGKILL when
   its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, kept across the ``exec`` into uvicorn), so
   it ends with the command however the command ends, ``kill -9`` included, at once. The request is tied to
   the thread that started the child, so it is made from the command's main thread.
4. It is stopped at exit like Prefect's own, from an ``atexit`` hook registered before any flow runs,
   so Prefect's log and event workers (registered later, run earlier) flush to it first. It runs in
   a process group of its own, so a Ctrl-C at the terminal reaches the command, which stops it when
   it has reported the interruption, and not the server directly.
5. Flows run against a temporary server send no heartbeats (:func:`flow_settings`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
from prefect.context import refresh_global_settings_context
from prefect.logging import get_logger
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

from rlhf_core.errors import UserError
from runtime.children import free_port, launch_tied, stop

logger = get_logger("rlhf.prefect_server")

_ADDRESS_IN_USE = 3  # uvicorn's exit code when the port was taken meanwhile
_STOP_SECONDS = 5.0
LEASES_ON_DISK = "prefect.server.concurrency.lease_storage.filesystem"
_launching: tuple[subprocess.Popen, str] | None = None
"""The temporary server :func:`start_prefect_api` launched and its API, until it answers."""
_started_url: str | None = None
"""The API of the temporary server :func:`ensure_prefect_api` started in this process, if it did."""


class PrefectServerError(UserError, RuntimeError):
    """The temporary Prefect server did not start."""


def _launch(port: int) -> subprocess.Popen:
    import prefect

    uvicorn = [
        "--app-dir", str(prefect.__module_path__.parent),
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip
    environment = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        # What Prefect sets for its own temporary server: no UI, ephemeral mode.
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    # Concurrency-slot leases on disk (under PREFECT_HOME), not in the server's memory: the server dies with its
    # command, and the campaign slot a killed run held must stay releasable by the next command (which finds its
    # lease recorded, flows.concurrency.campaign_slot) or revocable when the lease runs out. In memory, the lease
    # died with the server while the slot stayed taken in the database, and the next run waited forever.
    environment.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASES_ON_DISK)
    # In a process group of its own: Ctrl-C in a terminal signals the whole foreground group, and the server
    # must outlive the command's own handling of it (marking its runs) rather than stop under it. Killed outright
    # when the command dies (runtime.children): nothing is left to serve, and SQLite's journal keeps its database
    # whole; a command that ends stops it gracefully first (atexit).
    argv = [sys.executable, "-m", "uvicorn", *uvicorn]
    return launch_tied(sys.executable, argv, death_signal=signal.SIGKILL, env=environment)


def _wait_until_healthy(process: subprocess.Popen, url: str, timeout: float) -> bool:
    """True once the server answers, False if it exited because its port was taken.

    Raises:
        PrefectServerError: it exited otherwise, or did not answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            code = process.poll()
            if code == _ADDRESS_IN_USE:
                return False
            if code is not None:
                raise PrefectServerError(f"the temporary Prefect server exited with code {code} while starting")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{url}/health").status_code == 200:
                    return True
            time.sleep(0.1)
    stop(process, timeout=_STOP_SECONDS)
    raise PrefectServerError(
        f"the temporary Prefect server did not answer within {timeout:.0f} s "
        "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); or start one and set PREFECT_API_URL"
    )


def start_prefect_api() -> None:
    """Start launching the temporary server :func:`ensure_prefect_api` will wait for, and return at once.

    The server takes seconds to import and open its database; a command starts it first, so that it comes up
    while the command imports torch and checks its inputs. Does nothing where :func:`ensure_prefect_api` would
    start no server, or once one is launched. A command that fails before waiting for it stops it
    (:func:`stop_unused_prefect_api`).
    """
    global _launching
    settings = get_current_settings()
    if _launching is not None or settings.api.url or not settings.server.ephemeral.enabled:
        return
    if sys.platform.startswith("linux"):
        port = free_port()
        _launching = (_launch(port), f"http://127.0.0.1:{port}/api")
        atexit.register(stop, _launching[0], timeout=_STOP_SECONDS)


def stop_unused_prefect_api() -> None:
    """Stop the server :func:`start_prefect_api` launched if nothing waited for it: the command ended first (a
    refused input), and a process that runs commands one after another (the tests) must not keep it."""
    global _launching
    if _launching is not None:
        stop(_launching[0], timeout=_STOP_SECONDS)
        _launching = None


def ensure_prefect_api() -> None:
    """Make sure Prefect has an API to talk to: the configured server, or a temporary one owned by this process.

    Does nothing when ``PREFECT_API_URL`` is set (in the environment or the Prefect profile), when the
    profile forbids a temporary server, on a system without ``prctl``, or when this process already
    started one. Waits for the server :func:`start_prefect_api` launched, if it did.

    Raises:
        PrefectServerError: the temporary server did not start.
    """
    global _launching, _started_url
    if get_current_settings().api.url:  # configured since the launch (an API URL set in this context)
        stop_unused_prefect_api()
        return
    timeout = get_current_settings().server.ephemeral.startup_timeout_seconds
    for _ in range(3):
        start_prefect_api()
        if _launching is None:  # no temporary server is needed, or this process has one already
            return
        process, url = _launching
        healthy = _wait_until_healthy(process, url, timeout)  # interrupted, it is stop_unused_prefect_api's
        _launching = None
        if healthy:
            break
        # it exited: its port was taken between choosing it and binding it
    else:
        raise PrefectServerError("no free port for the temporary Prefect server after 3 tries")
    _started_url = os.environ["PREFECT_API_URL"] = url
    refresh_global_settings_context()
    logger.info("Started a temporary Prefect server on %s; it stops with this command", url.removesuffix("/api"))


@contextlib.contextmanager
def flow_settings() -> Iterator[None]:
    """The Prefect settings of the flows a command runs in its own process: no flow-run heartbeats when the
    Prefect server is a temporary one (this command's, or Prefect's own when no ``PREFECT_API_URL`` is set).

    Since Prefect 3.8 a flow run sends a heartbeat event every 180 s, for an automation on the server to spot a
    run whose process died. A temporary server ends with the command, so nothing watches for them; and the
    heartbeat thread sleeps in whole seconds while a finishing flow run waits for it, so every flow run (an
    iteration, its campaign, a replay) ended up to a second late: about an eighth of a demo iteration
    (``bench/RESULTS.md``, section 3). Against a server of the user's, Prefect's settings stand; and so does a
    heartbeat frequency set anywhere Prefect reads settings (environment, profile, ``prefect.toml``; inside
    Prefect's ``temporary_settings``, which counts every setting as set, Prefect's settings stand too).
    """
    settings = get_current_settings()
    temporary = settings.api.url is None or settings.api.url == _started_url
    if not temporary or "heartbeat_frequency" in settings.flows.model_fields_set:
        yield
        return
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
