"""Content fingerprints of the files a campaign reads (models, tokenizers, prompt and preference files).

A fingerprint is the sha256 over a file's bytes, or over a folder's relative file names and their
bytes, so a file edited in place, or a retrained checkpoint of the same size, always gets a new
one. Hashing a 14 GB model on every run would cost a minute, so each file's sha256 is kept in a
small cache keyed by its absolute path, size, modification time (ns), change time (ns) and inode: a
file is read again only when one of those changes. The change time is the one a user cannot set: a
byte flipped with the modification time put back (``touch -r``) still changes it.

Choices:
1. The cache is one JSON file, written to a temporary name and renamed, so a crash never leaves
   it half written; an unreadable cache is ignored (everything is hashed again).
2. Entries for files that no longer match are replaced, never trusted.
3. A file modified in the last :data:`SETTLE_SECONDS` is hashed but not remembered: file systems
   stamp times coarsely (a few ms), so a file rewritten again within the same tick, at the same
   size, would keep its stamps, and a remembered hash would go stale ("racily clean" in git's
   terms). A write moves both stamps together, so the modification time alone says when to trust.
4. A stage output's files are remembered as their stage writes them (:func:`remember_written`): the stage hashed
   each one from disk as it published it (its manifest's sha256), so the first check of a finished campaign reads
   none of them again (issue 42: a campaign's checkpoints can be terabytes). Choice 3 still holds when such an entry
   is read: it is trusted once its file has settled. What it cannot see is another writer rewriting the file to the
   same size within the same clock tick as its stage's own last write, inside the stage's hidden folder.
5. A save merges: entries other processes saved meanwhile are kept, this process's win where both hold one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from storage.files import file_sha256, write_text_replacing

logger = logging.getLogger(__name__)

_CACHE_VERSION = 2  # 1 had no change time: its entries are hashed again once
SETTLE_SECONDS = 2.0


def _stat_key(path: Path) -> tuple[str, bool]:
    """``(size:mtime:ctime:inode, whether the file has settled)`` (see choice 3)."""
    stat = path.stat()
    settled = time.time_ns() - stat.st_mtime_ns > SETTLE_SECONDS * 1e9
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}", settled


class FingerprintCache:
    """sha256 of files, remembered by (path, size, mtime, ctime, inode) in ``cache_file`` (None: no cache)."""

    def __init__(self, cache_file: Path | None) -> None:
        self.cache_file = cache_file
        self._entries: dict[str, dict[str, str]] | None = None  # read at the first lookup: a writer needs none
        self._changed: dict[str, dict[str, str]] = {}  # hashed or remembered here since the last save

    def _known(self) -> dict[str, dict[str, str]]:
        if self._entries is None:
            self._entries = self._read() if self.cache_file is not None else {}
        return self._entries

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            raw = json.loads(self.cache_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            logger.warning("ignoring unreadable fingerprint cache %s: %s", self.cache_file, error)
            return {}
        if not isinstance(raw, dict) or raw.get("version") != _CACHE_VERSION or not isinstance(raw.get("files"), dict):
            return {}
        return raw["files"]

    def file_sha256(self, path: Path) -> str:
        """The sha256 of one file, from the cache when its path, size, mtime, ctime and inode match."""
        path = Path(path).resolve()
        key, settled = _stat_key(path)
        entry = self._changed.get(str(path)) or self._known().get(str(path))
        if entry is not None and entry.get("stat") == key and settled:
            return entry["sha256"]
        sha256 = file_sha256(path)
        if settled:
            self._remember(path, key, sha256)
        return sha256

    def _remember(self, path: Path, key: str, sha256: str) -> None:
        self._changed[str(path)] = {"stat": key, "sha256": sha256}

    def remember(self, path: Path, sha256: str) -> None:
        """Remember ``sha256`` as the content of ``path`` as it is now, which its writer hashed (choice 4)."""
        path = Path(path).resolve()
        self._remember(path, _stat_key(path)[0], sha256)

    def fingerprint(self, path: Path) -> str:
        """sha256 of a file's content, or of a folder's relative file names and contents.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if path.is_file():
            return self.file_sha256(path)
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
            digest.update(self.file_sha256(file).encode())
        return digest.hexdigest()

    def save(self) -> None:
        """Write the cache if anything was hashed anew, beside what other processes saved meanwhile (choice 5)."""
        if self.cache_file is None or not self._changed:
            return
        self._entries = {**self._read(), **self._changed}
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_replacing(
            self.cache_file, json.dumps({"version": _CACHE_VERSION, "files": self._entries}, sort_keys=True)
        )
        self._changed = {}


def remember_written(cache_file: Path, folder: Path, files: Iterable[tuple[str, str]]) -> None:
    """Remember in ``cache_file`` the sha256 of each file of ``folder`` its writer just hashed: ``files`` are
    ``(path relative to folder, sha256)``, as a stage output's manifest lists them (choice 4). One read of the cache
    file and one write."""
    cache = FingerprintCache(cache_file)
    for relative, sha256 in files:
        cache.remember(folder / relative, sha256)
    cache.save()
