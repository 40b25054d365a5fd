"""An exclusive, crash-safe lock on a run folder: two iterations of one campaign never run at once.

``fcntl.flock`` locks belong to the open file, so the kernel drops the lock when its process
dies, ``kill -9`` included: a crashed run never leaves a stale lock behind. It covers processes on
one machine (or one shared file system that honours flock); a deployment spread over several
machines would use a Prefect global concurrency limit instead.

The lock file is opened without following a symbolic link and refused unless it is a plain file
with one name, so a link planted at its place never gets its target truncated. It records the
holder's pid, which :func:`lock_holder` reads to say who holds it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.errors import UserError

logger = logging.getLogger(__name__)


class LockTimeout(TimeoutError):
    """The lock stayed held by another process for longer than the caller would wait."""


class UnsafeLockFile(UserError, OSError):
    """The lock file is a symbolic link, or not a plain file with one name: writing to it could hit another file."""


def _open(path: Path) -> int:
    """A descriptor of the lock file (created if missing), never through a link.

    Raises:
        UnsafeLockFile: ``path`` is a symbolic link, a hard link with other names, or not a regular file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeLockFile(f"{path} is a symbolic link; the lock must be a plain file: remove the link") from None
        raise
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(descriptor)
        raise UnsafeLockFile(f"{path} is not a plain file with a single name; remove it (it is recreated)")
    return descriptor


class LockHeld(UserError, RuntimeError):
    """Another process holds the lock (:func:`refuse_if_locked`)."""


def refuse_if_locked(path: Path, *, what: str) -> None:
    """Raise :class:`LockHeld`, naming ``what`` and the holder's pid, if another process holds the lock on ``path``.

    A check, not a lock: a caller that then takes the lock may still wait if another process came first.
    """
    pid = lock_holder(path)
    if pid is not None:
        holder = f"process {pid}" if pid else "another process"
        raise LockHeld(f"{what} is being run by {holder} ({path} is locked); wait for it to finish or stop it")


def lock_holder(path: Path) -> int | None:
    """The pid of the process holding the lock on ``path`` (0 if it wrote none yet), or None when it is free.

    Raises:
        UnsafeLockFile: see :func:`exclusive_lock`.
    """
    if not path.exists() and not path.is_symlink():
        return None
    descriptor = _open(path)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a shared probe never blocks another prober
        except BlockingIOError:
            text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return None
    finally:
        os.close(descriptor)


@contextmanager
def exclusive_lock(path: Path, *, timeout: float | None = None, poll_seconds: float = 1.0) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block.

    Args:
        path: the lock file.
        timeout: seconds to wait for another holder; None waits for as long as it takes.
        poll_seconds: how often to retry while waiting.

    Raises:
        LockTimeout: still held by another process after ``timeout`` seconds.
        UnsafeLockFile: ``path`` is a symbolic link, a hard link with other names, or not a regular file.
    """
    descriptor = _open(path)
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
