"""An exclusive, crash-safe lock on a run folder: two iterations of one campaign never run at once.

``fcntl.flock`` locks belong to the open file, so the kernel drops the lock when its process
dies, ``kill -9`` included: a crashed run never leaves a stale lock behind. It covers processes on
one machine (or one shared file system that honours flock); a deployment spread over several
machines would use a Prefect global concurrency limit instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


class LockTimeout(TimeoutError):
    """The lock stayed held by another process for longer than the caller would wait."""


@contextmanager
def exclusive_lock(path: Path, *, timeout: float | None = None, poll_seconds: float = 1.0) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block.

    Args:
        path: the lock file.
        timeout: seconds to wait for another holder; None waits for as long as it takes.
        poll_seconds: how often to retry while waiting.

    Raises:
        LockTimeout: still held by another process after ``timeout`` seconds.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited_since = time.monotonic()
        announced = False
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if timeout is not None and time.monotonic() - waited_since > timeout:
                    raise LockTimeout(f"{path} is still locked by another run after {timeout:.0f} s") from None
                if not announced:
                    logger.info("waiting for another run holding %s to finish", path)
                    announced = True
                time.sleep(poll_seconds)
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(descriptor)
