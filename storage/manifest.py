"""Manifests: what a stage output holds, what produced it, and proof that its bytes are intact.

Choices:

1. A stage output is a folder with any files (Parquet shards, checkpoint folders) plus
   ``_manifest.json`` listing every file with its size, sha256 and (for Parquet) row count.
2. ``input_key`` is the sha256 of the canonical JSON of the stage name, the settings it ran
   with, its upstream manifests' digests, the fingerprint of the code it ran and
   ``SCHEMA_VERSION``. Equal inputs give equal keys whatever the dict order; any change gives a
   new key (and so a new folder).
3. The manifest stores a sha256 of its own canonical body (``manifest_sha256``), so an edited
   manifest is caught as surely as an edited shard. Anyone can compute that checksum again, so a manifest
   naming a file outside its folder (``../x``, an absolute path) is refused when it is parsed, before
   anything (verifying, pruning) touches the file it names. Its :attr:`Manifest.digest`, the value
   downstream stages put in their ``upstream``, covers only the content's identity (stage, input
   key, schema version, files), so a re-run that produces the same bytes has the same digest and
   everything downstream keeps its input keys: that is what lets a resumed run equal one that
   never crashed. What the digest leaves out (the config, upstream digests and code a manifest records) is bound
   to it through the input key: a manifest is read only if its input key is the key of the inputs it records, so
   one signed again with another upstream or config is refused, not taken for what computed the output.
4. :class:`StageOutput` makes a whole stage output atomic: everything is written into a hidden
   sibling folder that is renamed into place only after the manifest is written, so a folder
   under its real name is always complete. Existing outputs are never replaced.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.errors import UserError
from storage.files import TEMPORARY_MARK, FileEntry, file_sha256, fsync_directory, temporary_sibling
from storage.fingerprints import FingerprintCache
from storage.schemas import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION
from storage.shards import write_shards

__all__ = [
    "MANIFEST_FILE",
    "CorruptOutputError",
    "FileEntry",
    "Manifest",
    "StageOutput",
    "UnsupportedSchemaError",
    "canonical_json",
    "compute_input_key",
    "find_stage_output",
    "package_version",
    "prunable_digest",
    "prunable_present",
    "prune_files",
    "read_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "_manifest.json"
_CHECKSUM_KEY = "manifest_sha256"


class CorruptOutputError(UserError):
    """A stage output whose files do not match its manifest, or whose manifest is unreadable.

    Attributes:
        path: the offending file (or folder).
    """

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


class UnsupportedSchemaError(CorruptOutputError):
    """A manifest written with another ``SCHEMA_VERSION``: intact, but not readable by this version."""


@functools.cache
def package_version() -> str:
    """This project's installed version (``0+unknown`` when it runs from a source tree uninstalled)."""
    try:
        return importlib.metadata.version("rlhf-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _reject(value: object) -> object:
    raise TypeError(f"cannot put a {type(value).__name__} into a manifest or input key: {value!r}")


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal text.

    Tuples become lists and ints stay distinct from floats (``1`` and ``1.0`` differ). Anything
    that is not a dict, list, tuple, str, int, float, bool or None is refused with a TypeError.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_reject)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def compute_input_key(
    stage: str,
    settings: Mapping[str, Any],
    upstream: Mapping[str, str],
    *,
    code: str,
    schema_version: int = SCHEMA_VERSION,
) -> str:
    """The identity of a stage's inputs: what decides whether an existing output can be reused.

    Args:
        stage: the stage name.
        settings: everything the stage's result depends on besides its upstream outputs and code
            (nested dicts, lists, str, numbers, bools, None).
        upstream: upstream stage name -> that output's :attr:`Manifest.digest`.
        code: a fingerprint of the code the stage runs.
        schema_version: the schema the output is written in (an older one: to check an older output's key).

    Returns:
        A 64-character hex sha256.
    """
    body = {
        "stage": stage,
        "settings": dict(settings),
        "upstream": dict(upstream),
        "code": code,
        "schema_version": schema_version,
    }
    return _sha256_text(canonical_json(body))


@dataclass(frozen=True)
class Manifest:
    """The record of one stage output (``_manifest.json``).

    Args:
        stage: the stage that wrote it.
        input_key: :func:`compute_input_key` of the inputs that produced it.
        schema_version: ``SCHEMA_VERSION`` when it was written.
        files: every file of the output except the manifest, sorted by path.
        config: the settings the stage ran with (part of the input key).
        upstream: upstream stage name -> upstream manifest digest.
        code: the fingerprint of the code the stage ran (part of the input key).
        metrics: summary numbers of the stage (e.g. held-out accuracy, seconds, peak memory).
        runtime: where it ran (device, precision, models loaded, threads); not part of the input key.
        created_at: ISO 8601 UTC time of writing.
        package_version: this project's version when it was written.
    """

    stage: str
    input_key: str
    schema_version: int
    files: tuple[FileEntry, ...]
    config: dict[str, Any]
    upstream: dict[str, str]
    code: str
    metrics: dict[str, float]
    runtime: dict[str, Any]
    created_at: str
    package_version: str

    def to_dict(self) -> dict[str, Any]:
        """The manifest body as plain JSON values (without the self-checksum)."""
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body["files"] = [entry.to_dict() for entry in self.files]
        return body

    def rows(self, table: str) -> int:
        """The rows of the output's ``table`` (its ``<table>-*`` shards), as written: no file is read."""
        return sum(entry.rows or 0 for entry in self.files if entry.path.startswith(f"{table}-"))

    @property
    def digest(self) -> str:
        """The content's identity: sha256 of the stage, input key, schema version and every file's
        hash. Downstream stages record it as ``upstream``. Metrics, the runtime and the creation
        time are left out, so the same inputs always give the same digest, in any run on any machine."""
        identity = {
            "stage": self.stage,
            "input_key": self.input_key,
            "schema_version": self.schema_version,
            "files": [entry.to_dict() for entry in self.files if not entry.prunable],
        }
        return _sha256_text(canonical_json(identity))

    @property
    def checksum(self) -> str:
        """sha256 of the whole canonical JSON body: detects any edit of the manifest itself."""
        return _sha256_text(canonical_json(self.to_dict()))

    def to_json(self) -> str:
        """Pretty JSON of the body plus ``manifest_sha256`` (= :attr:`checksum`)."""
        return json.dumps({**self.to_dict(), _CHECKSUM_KEY: self.checksum}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse :meth:`to_json` output and check its self-checksum.

        Raises:
            ValueError: the text is not a manifest, or its checksum does not match its body.
        """
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not valid JSON: {error}") from error
        if not isinstance(raw, dict):
            raise ValueError("a manifest must be a JSON object")
        checksum = raw.pop(_CHECKSUM_KEY, None)
        names = [f.name for f in dataclasses.fields(cls)]
        if sorted(raw) != sorted(names):
            raise ValueError(f"manifest keys {sorted(raw)} differ from the expected {sorted(names)}")
        try:
            files = tuple(
                FileEntry(
                    path=str(e["path"]),
                    sha256=str(e["sha256"]),
                    bytes=int(e["bytes"]),
                    rows=e["rows"],
                    prunable=bool(e["prunable"]),
                )
                for e in raw["files"]
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed `files` entry: {error!r}") from error
        for entry in files:
            if not _safe_relative(entry.path) or entry.path == MANIFEST_FILE:
                raise ValueError(
                    f"it lists an invalid path {entry.path!r}: a manifest names files of its own folder only"
                )
        manifest = cls(**{**raw, "files": files})
        if checksum != manifest.checksum:
            raise ValueError(f"`{_CHECKSUM_KEY}` {checksum!r} does not match the manifest body ({manifest.checksum})")
        return manifest


def _safe_relative(path: str) -> bool:
    pure = PurePosixPath(path)
    return bool(path) and not pure.is_absolute() and ".." not in pure.parts and pure.as_posix() == path


def read_manifest(stage_dir: Path, *, verify: bool = True, cache: FingerprintCache | None = None) -> Manifest:
    """Read a stage output's manifest and (with ``verify``) check every byte it lists.

    Checks, in order: the manifest parses, names only files inside its folder and its self-checksum
    matches; its schema version is this code's; every listed file exists with the listed size and
    sha256; no unlisted file sits in the folder.

    Args:
        stage_dir: the stage output folder.
        verify: check the files too (hashes every byte); without it only the manifest is checked.
        cache: sha256s already known by path, size and modification time (:mod:`storage.fingerprints`): a file
            whose size and modification time are unchanged since it was hashed is not read again. None reads
            every byte.

    Returns:
        The manifest.

    Raises:
        FileNotFoundError: ``stage_dir`` does not exist.
        CorruptOutputError: any check failed; ``path`` and the message name the offending file.
        UnsupportedSchemaError: the output was written with a schema version this one does not read.
    """
    stage_dir = Path(stage_dir)
    if not stage_dir.is_dir():
        raise FileNotFoundError(f"no stage output folder {stage_dir}")
    manifest_path = stage_dir / MANIFEST_FILE
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CorruptOutputError(f"{manifest_path} is missing", path=manifest_path) from None
    except (OSError, UnicodeDecodeError) as error:
        raise CorruptOutputError(f"{manifest_path} cannot be read: {error}", path=manifest_path) from error
    _refuse_other_schema(stage_dir, text)
    try:
        manifest = Manifest.from_json(text)
    except (ValueError, TypeError) as error:
        raise CorruptOutputError(f"{manifest_path} is corrupt: {error}", path=manifest_path) from error
    if manifest.input_key != _recorded_inputs_key(manifest):
        raise CorruptOutputError(
            f"{manifest_path} is corrupt: the inputs it records (config, upstream outputs, code) are not the ones its "
            "input key was computed from",
            path=manifest_path,
        )
    if verify:
        _verify_files(stage_dir, manifest, cache)
    return manifest


def _recorded_inputs_key(manifest: Manifest) -> str | None:
    """The input key of the inputs ``manifest`` records (choice 3), or None where they cannot be keyed."""
    try:
        return compute_input_key(
            manifest.stage,
            manifest.config,
            manifest.upstream,
            code=manifest.code,
            schema_version=manifest.schema_version,
        )
    except (TypeError, ValueError):
        return None


def _refuse_other_schema(stage_dir: Path, text: str) -> None:
    """Raise :class:`UnsupportedSchemaError` for a manifest of a schema version this one does not read
    (:data:`storage.schemas.READABLE_SCHEMA_VERSIONS`).

    Read before the manifest is parsed: the fields of another version's manifest differ too.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        return  # not JSON at all: reported as corrupt by the parser
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if isinstance(version, int) and version not in READABLE_SCHEMA_VERSIONS:
        *earlier, last = map(str, READABLE_SCHEMA_VERSIONS)
        readable = f"{', '.join(earlier)} and {last}" if earlier else last
        raise UnsupportedSchemaError(
            f"{stage_dir} was written with schema version {version} (rlhf-pipeline "
            f"{raw.get('package_version', 'unknown')}); this version reads schema {readable} only: run the "
            "iteration again to recompute it",
            path=stage_dir / MANIFEST_FILE,
        )


def _verify_files(stage_dir: Path, manifest: Manifest, cache: FingerprintCache | None) -> None:
    listed = set()
    for entry in manifest.files:
        path = stage_dir / entry.path
        listed.add(entry.path)
        try:
            status = path.stat()
        except FileNotFoundError:
            if entry.prunable:
                continue  # pruned
            status = None
        if status is None or not stat.S_ISREG(status.st_mode):
            raise CorruptOutputError(f"{path} is missing (listed in {MANIFEST_FILE})", path=path)
        size = status.st_size
        if size != entry.bytes:
            raise CorruptOutputError(f"{path} is {size} bytes; the manifest says {entry.bytes}", path=path)
        if (file_sha256(path) if cache is None else cache.file_sha256(path)) != entry.sha256:
            raise CorruptOutputError(f"{path} has been altered: its sha256 does not match the manifest", path=path)
    for path in _walk_files(stage_dir):
        relative = path.relative_to(stage_dir).as_posix()
        if relative != MANIFEST_FILE and relative not in listed:
            raise CorruptOutputError(f"{path} is not listed in {MANIFEST_FILE}", path=path)


def _walk_files(directory: Path) -> list[Path]:
    """Every file under ``directory``, sorted; a symlink or special file is an error. A folder's entries say what
    they are (``os.scandir``), so a rerun that checks every output costs no system call per file for this."""
    files = []
    folders = [str(directory)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise CorruptOutputError(
                        f"{entry.path} is a symbolic link; stage outputs hold plain files", path=Path(entry.path)
                    )
                if entry.is_dir():
                    folders.append(entry.path)
                elif entry.is_file():
                    files.append(entry.path)
                else:
                    raise CorruptOutputError(f"{entry.path} is not a plain file", path=Path(entry.path))
    return [Path(path) for path in sorted(files)]


def find_stage_output(final_dir: Path, input_key: str) -> Manifest | None:
    """The verified manifest of an existing output for ``input_key``, or None if there is none.

    Args:
        final_dir: the stage output folder (``RunLayout.stage_dir(stage, input_key)``).
        input_key: the key the caller is about to compute an output for.

    Returns:
        The manifest, or None when the folder does not exist or holds another key's output (a
        folder-name prefix collision, logged as a warning).

    Raises:
        CorruptOutputError: the folder exists but fails verification.
    """
    final_dir = Path(final_dir)
    if not final_dir.exists():
        return None
    try:
        manifest = read_manifest(final_dir, verify=True)
    except UnsupportedSchemaError:
        raise
    except CorruptOutputError as error:
        raise CorruptOutputError(f"{error}; delete {final_dir} to recompute it", path=error.path) from error
    if manifest.input_key != input_key:
        logger.warning("%s holds input key %s, not %s", final_dir, manifest.input_key, input_key)
        return None
    return manifest


def _temporary_owner(path: Path, final_name: str) -> int | None:
    """The pid in a temporary folder name ``.{final}.tmp-{pid}-{hex}``, -1 if unparsable, None if not ours."""
    prefix = f".{final_name}{TEMPORARY_MARK}"
    if not path.name.startswith(prefix):
        return None
    match = re.fullmatch(r"(\d+)-[0-9a-f]+", path.name[len(prefix) :])
    return int(match.group(1)) if match else -1


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(final_dir: Path) -> None:
    """Delete ``.{name}.tmp-*`` siblings left by writers that died (their pid no longer runs)."""
    if not final_dir.parent.is_dir():
        return
    for sibling in final_dir.parent.iterdir():
        owner = _temporary_owner(sibling, final_dir.name)
        if owner is not None and not _process_alive(owner):
            logger.warning("removing %s, left by a writer that did not finish", sibling)
            shutil.rmtree(sibling, ignore_errors=True)


def _refuse_existing(final_dir: Path) -> None:
    if not final_dir.exists():
        return
    try:
        read_manifest(final_dir, verify=True)
    except CorruptOutputError as error:
        raise CorruptOutputError(
            f"{final_dir} exists but is not a valid stage output ({error}); delete it to recompute it",
            path=error.path,
        ) from error
    raise FileExistsError(f"{final_dir} already holds a stage output; outputs are never overwritten silently")


@dataclass
class StageOutput:
    """Write one stage output atomically.

    Example::

        with StageOutput(final_dir, stage="rollout", input_key=key, config=cfg, upstream=up, code=code) as out:
            out.write_table("experience", table, schema=EXPERIENCE)
            model.save_pretrained(out.path / "actor")
            out.metrics["rollout/score_mean"] = 0.3
        manifest = out.manifest

    On entry, remnants of writers that crashed are removed and a hidden sibling folder is created
    (:attr:`path`). On a normal exit every file under it is hashed and fsynced, the manifest is
    written, and the folder is renamed to ``final_dir``. On an exception the folder is deleted and
    the exception propagates; nothing appears under ``final_dir``.

    Args:
        final_dir: where the output will live (``RunLayout.stage_dir(stage, input_key)``).
        stage: the stage name.
        input_key: :func:`compute_input_key` of the stage's inputs (checked: :class:`ValueError` otherwise).
        config: the stage's settings, recorded in the manifest.
        upstream: upstream stage name -> upstream manifest digest, recorded in the manifest.
        code: the fingerprint of the code that produces the output, recorded in the manifest.

    Fill :attr:`metrics` and :attr:`runtime` inside the block; they are recorded too. Add to
    :attr:`prunable` the relative paths (files or folders) that may be deleted later without
    changing the output's identity (see :func:`prune_files`).

    Raises:
        FileExistsError: on entry or exit, ``final_dir`` already holds a valid output.
        CorruptOutputError: on entry, ``final_dir`` exists but is not a valid output.
    """

    final_dir: Path
    stage: str = field(kw_only=True)
    input_key: str = field(kw_only=True)
    config: Mapping[str, Any] = field(kw_only=True)
    upstream: Mapping[str, str] = field(kw_only=True)
    code: str = field(kw_only=True)
    metrics: dict[str, float] = field(default_factory=dict, init=False)
    runtime: dict[str, Any] = field(default_factory=dict, init=False)
    prunable: set[str] = field(default_factory=set, init=False)
    _path: Path | None = field(default=None, init=False, repr=False)
    _manifest: Manifest | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.final_dir = Path(self.final_dir).absolute()
        self.config = dict(self.config)
        self.upstream = dict(self.upstream)
        key = compute_input_key(self.stage, self.config, self.upstream, code=self.code)  # unserialisable: now
        if self.input_key != key:
            raise ValueError(f"input_key {self.input_key} is not the key of this config, upstream and code ({key})")

    @property
    def path(self) -> Path:
        """The temporary folder to write into (only inside the ``with`` block)."""
        if self._path is None:
            raise RuntimeError("`StageOutput.path` exists only inside the `with` block")
        return self._path

    @property
    def manifest(self) -> Manifest:
        """The manifest written on a successful exit."""
        if self._manifest is None:
            raise RuntimeError("`StageOutput.manifest` exists only after the `with` block exits normally")
        return self._manifest

    def write_table(
        self, name: str, table: pa.Table, *, schema: pa.Schema, rows_per_shard: int = 4096
    ) -> list[FileEntry]:
        """Write ``table`` as shards ``{name}-{i:05d}.parquet`` into :attr:`path` (see :func:`write_shards`)."""
        return write_shards(self.path, name, table, schema=schema, rows_per_shard=rows_per_shard)

    def __enter__(self) -> StageOutput:
        if self._path is not None or self._manifest is not None:
            raise RuntimeError("a StageOutput can be entered only once")
        _refuse_existing(self.final_dir)
        _remove_stale_temporaries(self.final_dir)
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        name = temporary_sibling(self.final_dir).name
        self._path = self.final_dir.parent / name
        self._path.mkdir()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        temporary = self.path
        try:
            if kind is None:
                self._manifest = self._finish(temporary)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)

    def _finish(self, temporary: Path) -> Manifest:
        if (temporary / MANIFEST_FILE).exists():
            raise ValueError(f"{MANIFEST_FILE} is reserved for the manifest; do not write it yourself")
        entries = []
        for path in _walk_files(temporary):
            relative = path.relative_to(temporary).as_posix()
            sha256 = file_sha256(path, sync=True)
            rows = pq.read_metadata(path).num_rows if path.suffix == ".parquet" else None
            prunable = any(relative == prefix or relative.startswith(prefix + "/") for prefix in self.prunable)
            entries.append(FileEntry(relative, sha256, path.stat().st_size, rows, prunable))
        metrics = {key: float(value) for key, value in self.metrics.items()}
        if not all(math.isfinite(value) for value in metrics.values()):
            logger.warning("stage %s records non-finite metrics: %s", self.stage, metrics)
        manifest = Manifest(
            stage=self.stage,
            input_key=self.input_key,
            schema_version=SCHEMA_VERSION,
            files=tuple(sorted(entries, key=lambda entry: entry.path)),
            config=json.loads(canonical_json(self.config)),
            upstream=dict(self.upstream),
            code=self.code,
            metrics=metrics,
            runtime=json.loads(canonical_json(self.runtime)),
            created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            package_version=package_version(),
        )
        manifest_path = temporary / MANIFEST_FILE
        with open(manifest_path, "w", encoding="utf-8") as handle:
            handle.write(manifest.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        for folder in sorted({path.parent for path in _walk_files(temporary)}, reverse=True):
            fsync_directory(folder)
        if self.final_dir.exists():
            _refuse_existing(self.final_dir)
        try:
            os.rename(temporary, self.final_dir)
        except OSError as error:
            if self.final_dir.exists():
                raise FileExistsError(
                    f"{self.final_dir} was written by another writer meanwhile; outputs are never overwritten"
                ) from error
            raise
        fsync_directory(self.final_dir.parent)
        return manifest


def prune_files(stage_dir: Path) -> int:
    """Delete the prunable files of a stage output (its manifest keeps listing them); returns the bytes freed."""
    manifest = read_manifest(stage_dir, verify=False)
    freed = 0
    for entry in manifest.files:
        path = Path(stage_dir) / entry.path
        if entry.prunable and path.is_file():
            freed += path.stat().st_size
            path.unlink()
    for folder in sorted({(Path(stage_dir) / e.path).parent for e in manifest.files if e.prunable}, reverse=True):
        if folder != Path(stage_dir) and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    return freed


def prunable_digest(manifest: Manifest) -> str | None:
    """sha256 over the prunable entries of a manifest (as written, present or pruned), or None when it has none."""
    prunable = [entry.to_dict() for entry in manifest.files if entry.prunable]
    return _sha256_text(canonical_json(prunable)) if prunable else None


def prunable_present(stage_dir: Path, manifest: Manifest) -> bool:
    """Whether every prunable file of the output is still there (False when any was pruned)."""
    return all((Path(stage_dir) / entry.path).is_file() for entry in manifest.files if entry.prunable)
