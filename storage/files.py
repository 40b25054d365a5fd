"""File records and the byte-level helpers every writer shares: sha256, fsync, no-clobber publish.

:class:`FileEntry` is re-exported by :mod:`storage.manifest`, which is where callers should
import it from; it lives here only so :mod:`storage.shards` and :mod:`storage.manifest` do not
import each other.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20


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
