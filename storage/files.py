"""File records and the byte-level helpers every writer shares: sha256, fsync, no-clobber publish.

:class:`FileEntry` is re-exported by :mod:`storage.manifest`, which is where callers should
import it from; it lives here only so :mod:`storage.shards` and :mod:`storage.manifest` do not
import each other.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20
_NEARLY_FULL = 1 << 20


def cache_dir() -> Path:
    """This user's cache of the pipeline (``$RLHF_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlhf-pipeline``, else
    ``~/.cache/rlhf-pipeline``): what can be made again, kept to be made once."""
    if explicit := os.environ.get("RLHF_CACHE_DIR"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhf-pipeline"


@dataclass(frozen=True)
class FileEntry:
    """One file of a stage output.

    Args:
        path: path relative to the folder it was recorded in (the stage folder in a manifest), posix form.
        sha256: hex sha256 of the file's bytes.
        bytes: the file's size.
        rows: the row count for a Parquet file, None for any other file.
        prunable: the file may be deleted later (e.g. optimizer states, needed only to continue
            from the newest iteration); it is not part of the output's digest.
    """

    path: str
    sha256: str
    bytes: int
    rows: int | None = None
    prunable: bool = False

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "bytes": self.bytes,
            "rows": self.rows,
            "prunable": self.prunable,
        }


def file_sha256(path: Path, *, sync: bool = False) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks; with ``sync``, also fsync it to disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _disk_full(path: Path) -> bool:
    """Whether the file system holding ``path`` (or its nearest existing parent) has under 1 MiB left."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < _NEARLY_FULL


@contextlib.contextmanager
def disk_errors(path: Path) -> Iterator[None]:
    """Report a write that failed on a full disk as the ``OSError(ENOSPC)`` it is.

    safetensors and torch report a full disk in their own exception types (``SafetensorError``, a
    ``RuntimeError`` saying "file write failed"), with no errno to tell it from a bug; a file system
    left with less than 1 MiB after the failure is taken to be why. An ``ENOSPC`` that names no file (a write
    through an open stream, as pickle's) is given ``path``.
    """
    try:
        yield
    except OSError as error:
        if error.errno == errno.ENOSPC and error.filename is None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error
        raise
    except Exception as error:
        if _disk_full(Path(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error
        raise


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


TEMPORARY_MARK = ".tmp-"


def temporary_sibling(final: Path, *, what: str = TEMPORARY_MARK) -> Path:
    """The name a file or folder is written under before it is renamed to ``final``: ``.{name}.tmp-{pid}-{hex}``
    beside it, hidden, unique, and naming its writer (so a later one can remove what a dead one left,
    :func:`storage.manifest.StageOutput` does). The one write-then-rename naming of the project."""
    return final.with_name(f".{final.name}{what}{os.getpid()}-{uuid.uuid4().hex}")


def write_text_replacing(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a :func:`temporary_sibling` and a rename: a reader sees the old or the new
    text, never a part."""
    temporary = temporary_sibling(path)
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def publish_file(temporary: Path, final: Path) -> None:
    """Give a fully written file its real name, atomically, never replacing an existing file.

    A hard link fails if ``final`` exists, which closes the race a check-then-rename leaves open.
    Filesystems without hard links fall back to a check followed by ``os.replace``.

    Raises:
        FileExistsError: ``final`` already exists; ``temporary`` is removed.
    """
    try:
        os.link(temporary, final)
    except FileExistsError:
        temporary.unlink(missing_ok=True)
        raise FileExistsError(f"refusing to overwrite existing file {final}") from None
    except OSError:
        if final.exists():
            temporary.unlink(missing_ok=True)
            raise FileExistsError(f"refusing to overwrite existing file {final}") from None
        os.replace(temporary, final)
        return
    temporary.unlink()
