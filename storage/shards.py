"""Parquet shards: fixed rows per file, zstd-compressed, written under a temporary name then published.

Choices:

1. A table ``name`` is the files ``{name}-00000.parquet``, ``{name}-00001.parquet``, ... in one
   folder; shard ``i`` holds rows ``[i * rows_per_shard, (i + 1) * rows_per_shard)``.
2. Each shard is written to a hidden temporary file, fsynced, and only then given its real name
   with a no-clobber hard link (:func:`storage.files.publish_file`), so a crash never leaves half a
   shard under a real name and an existing shard is never replaced.
3. Every table is checked and cast against its explicit schema before anything is written
   (:func:`storage.schemas.conform`); an empty table still writes one (empty) shard so its schema
   survives.
4. Reads are whole-table (:func:`read_table`), with the exact Arrow types that were written, or lazy
   (:func:`scan_table`: a polars scan that reads only what a query needs).
5. A table assembled from pieces computed apart (the shards of a fanned-out stage) writes each piece
   as one file the same way (:func:`write_piece`), then the whole table as above.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from storage.files import FileEntry, file_sha256, fsync_directory, publish_file, temporary_sibling
from storage.schemas import conform

COMPRESSION = "zstd"


def shard_name(name: str, index: int) -> str:
    """The file name of shard ``index`` of table ``name``."""
    return f"{name}-{index:05d}.parquet"


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.]*", name):
        raise ValueError(f"`name` must be letters, digits, '_' or '.', got {name!r}")


def shard_paths(directory: Path, name: str) -> list[Path]:
    """The shards of table ``name`` in ``directory``, in shard order (empty if there are none)."""
    _check_name(name)
    pattern = re.compile(rf"{re.escape(name)}-(\d{{5,}})\.parquet")
    found = []
    for path in Path(directory).iterdir() if Path(directory).is_dir() else ():
        match = pattern.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def write_shards(
    directory: Path, name: str, table: pa.Table, *, schema: pa.Schema, rows_per_shard: int = 4096
) -> list[FileEntry]:
    """Write ``table`` as Parquet shards of ``rows_per_shard`` rows into ``directory``.

    Args:
        directory: the folder to write into; created if missing.
        name: the table name; shards are ``{name}-{i:05d}.parquet``.
        table: the rows; cast to ``schema`` first.
        schema: the table's schema (from :mod:`storage.schemas`).
        rows_per_shard: rows per file; the last shard holds the rest.

    Returns:
        One :class:`FileEntry` per shard, with paths relative to ``directory``.

    Raises:
        ValueError: the table does not match ``schema`` (the message names the column).
        FileExistsError: a shard of that name already exists (nothing is written).
    """
    _check_name(name)
    if rows_per_shard <= 0:
        raise ValueError(f"`rows_per_shard` must be positive, got {rows_per_shard}")
    table = conform(table, schema)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if existing := shard_paths(directory, name):
        raise FileExistsError(f"refusing to overwrite existing shard {existing[0]}")
    starts = range(0, table.num_rows, rows_per_shard) if table.num_rows else [0]
    written: list[Path] = []
    entries = []
    try:
        for index, start in enumerate(starts):
            final = directory / shard_name(name, index)
            temporary = temporary_sibling(final)
            shard = table.slice(start, rows_per_shard)
            try:
                pq.write_table(shard, temporary, compression=COMPRESSION)
                sha256 = file_sha256(temporary, sync=True)
                publish_file(temporary, final)
            finally:
                temporary.unlink(missing_ok=True)
            written.append(final)
            entries.append(FileEntry(final.name, sha256, final.stat().st_size, shard.num_rows))
    except BaseException:
        # A table is all or nothing: take back the shards this call already published.
        for path in written:
            path.unlink(missing_ok=True)
        raise
    fsync_directory(directory)
    return entries


def read_table(directory: Path, name: str) -> pa.Table:
    """Read every shard of table ``name`` in ``directory``, in order, as one Arrow table.

    Raises:
        FileNotFoundError: there is no shard of that name.
    """
    paths = shard_paths(directory, name)
    if not paths:
        raise FileNotFoundError(f"no shards of table {name!r} in {directory}")
    tables = [pq.read_table(path) for path in paths]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def scan_table(directory: Path, name: str) -> pl.LazyFrame:
    """A lazy polars scan of every shard of table ``name`` in ``directory``, in order: nothing is read until it is
    collected, and then only the columns and row groups the query needs.

    Raises:
        FileNotFoundError: there is no shard of that name.
    """
    paths = shard_paths(directory, name)
    if not paths:
        raise FileNotFoundError(f"no shards of table {name!r} in {directory}")
    return pl.scan_parquet(paths)


def write_piece(path: Path, table: pa.Table, *, schema: pa.Schema) -> None:
    """Write ``table`` as the one Parquet file ``path``, published atomically (never a half file).

    Raises:
        ValueError: the table does not match ``schema``.
        FileExistsError: ``path`` exists (an identical piece was already written: nothing is replaced).
    """
    table = conform(table, schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(path)
    try:
        pq.write_table(table, temporary, compression=COMPRESSION)
        file_sha256(temporary, sync=True)
        publish_file(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_piece(path: Path, *, schema: pa.Schema) -> pa.Table:
    """The table in the Parquet file ``path``, with exactly ``schema``."""
    return conform(pq.read_table(path), schema)
