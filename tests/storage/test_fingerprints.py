"""Content fingerprints: any content change is seen, an unchanged file is not read again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import storage.fingerprints
from storage.fingerprints import FingerprintCache


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """Every file the cache hashes, in order."""
    seen: list[Path] = []
    real = storage.fingerprints.file_sha256

    def counting(path, **kwargs):
        seen.append(Path(path))
        return real(path, **kwargs)

    monkeypatch.setattr(storage.fingerprints, "file_sha256", counting)
    return seen


def _settle(*paths: Path, age: float = 10.0) -> None:
    """Date the files ``age`` seconds back, past the window in which a fresh file's hash is not remembered."""
    then = time.time_ns() - int(age * 1e9)
    for path in paths:
        os.utime(path, ns=(then, then))


def test_an_edit_of_the_same_size_and_time_is_still_a_new_fingerprint(tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n')
    before = FingerprintCache(None).fingerprint(path)
    stat = path.stat()
    path.write_text('{"prompt": "b"}\n')  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same modification time
    assert FingerprintCache(None).fingerprint(path) != before  # without a cache, content decides


def test_the_cache_reads_a_file_once_until_it_changes(tmp_path: Path, reads: list[Path]):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    _settle(model / "config.json", model / "model.safetensors")
    cache_file = tmp_path / "cache" / "fingerprints.json"
    first = FingerprintCache(cache_file)
    fingerprint = first.fingerprint(model)
    first.save()
    assert len(reads) == 2
    assert FingerprintCache(cache_file).fingerprint(model) == fingerprint and len(reads) == 2  # from the cache
    (model / "model.safetensors").write_bytes(b"\1" * 1000)  # retrained: same size, new bytes and time
    _settle(model / "model.safetensors", age=5.0)
    changed = FingerprintCache(cache_file).fingerprint(model)
    assert changed != fingerprint and reads[-1].name == "model.safetensors" and len(reads) == 3


def test_issue42_a_byte_flipped_with_its_modification_time_put_back_is_seen_through_the_cache(
    tmp_path: Path, reads: list[Path]
):
    """``touch -r`` puts back the size and modification time of an edited file; the change time it cannot, so the
    remembered hash is not trusted."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 1000)
    _settle(path)
    cache_file = tmp_path / "fingerprints.json"
    first = FingerprintCache(cache_file)
    before = first.fingerprint(path)
    first.save()
    stat = path.stat()
    with path.open("r+b") as weights:  # one byte flipped in place: same size, same inode
        weights.seek(500)
        weights.write(b"\1")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # touch -r: the old modification time
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_ino == stat.st_ino
    assert FingerprintCache(cache_file).fingerprint(path) != before and len(reads) == 2


def test_a_folder_fingerprint_covers_names_and_contents(tmp_path: Path):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        (folder / "a.txt").write_text("x")
    (two / "b.txt").write_text("")  # an extra empty file is a different folder
    cache = FingerprintCache(None)
    assert cache.fingerprint(one) != cache.fingerprint(two)
    with pytest.raises(FileNotFoundError):
        cache.fingerprint(tmp_path / "missing")


def test_an_unreadable_cache_is_ignored(tmp_path: Path):
    cache_file = tmp_path / "fingerprints.json"
    cache_file.write_text("{not json")
    (tmp_path / "f").write_text("x")
    _settle(tmp_path / "f")
    cache = FingerprintCache(cache_file)
    assert cache.fingerprint(tmp_path / "f") == FingerprintCache(None).fingerprint(tmp_path / "f")
    cache.save()
    assert FingerprintCache(cache_file)._known()  # rewritten whole


def test_issue14_a_file_still_being_written_is_hashed_but_not_remembered(tmp_path: Path, reads: list[Path]):
    """Two same-size writes within one time-stamp tick leave size, time and inode equal: only the content differs."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n')
    stamp = path.stat().st_mtime_ns
    cache_file = tmp_path / "fingerprints.json"
    cache = FingerprintCache(cache_file)
    first = cache.fingerprint(path)
    cache.save()
    path.write_text('{"prompt": "b"}\n')
    os.utime(path, ns=(stamp, stamp))  # the same tick
    assert FingerprintCache(cache_file).fingerprint(path) != first
    assert len(reads) == 2


def test_issue42_files_remembered_as_written_are_not_read_again_and_an_edit_after_is_still_seen(
    tmp_path: Path, reads: list[Path]
):
    """A stage output's files are remembered with the sha256 its writer computed: once settled, the first check
    reads none of them; a byte flipped afterwards (``touch -r``) is hashed again; a save keeps what another process
    saved meanwhile."""
    output = tmp_path / "rollout" / "0123456789abcdef"
    output.mkdir(parents=True)
    (output / "experience-00000.parquet").write_bytes(b"\0" * 1000)
    (output / "actor").mkdir()
    (output / "actor" / "model.safetensors").write_bytes(b"\2" * 500)
    written = [(path.relative_to(output).as_posix(), storage.fingerprints.file_sha256(path)) for path in
               sorted(p for p in output.rglob("*") if p.is_file())]  # fmt: skip
    reads.clear()
    _settle(*(output / relative for relative, _ in written))
    cache_file = tmp_path / "cache" / "fingerprints.json"
    other = FingerprintCache(cache_file)  # another process, with an input it hashed
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')
    _settle(tmp_path / "prompts.jsonl")
    other.fingerprint(tmp_path / "prompts.jsonl")
    storage.fingerprints.remember_written(cache_file, output, written)
    other.save()  # saved after the stage remembered its files: both are kept
    reads.clear()
    cache = FingerprintCache(cache_file)
    assert [cache.file_sha256(output / relative) for relative, _ in written] == [sha for _, sha in written]
    cache.file_sha256(tmp_path / "prompts.jsonl")
    assert reads == []
    shard = output / "experience-00000.parquet"
    stat = shard.stat()
    with shard.open("r+b") as handle:
        handle.seek(10)
        handle.write(b"\1")
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert FingerprintCache(cache_file).file_sha256(shard) != written[1][1] and reads == [shard.resolve()]
