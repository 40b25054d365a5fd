"""Code fingerprints: a hash of the code that computes a stage's output, part of its input key.

A stage's output depends on its code as much as on its settings: editing the maths of ``rlhf_core/gae.py``, the
seed derivation, how a model is loaded or how a chat prompt is rendered must re-run the stages of an unfinished
iteration that ran it, not reuse what the old code wrote. Editing a comment, a docstring or the layout must not. So
the fingerprint of a stage covers what runs it: its module and every module of *our own code* that module imports,
directly or through others (found by reading the import statements, without importing anything), each *normalised*:
its syntax tree without docstrings (comments and layout never reach the tree). A stage that samples on the vLLM
engine adds the engine's server and identity (:mod:`runtime.engine`).

Choices:
1. Our own code is every module that is not installed: this project's packages (:data:`FIRST_PARTY`), and the
   modules of a user's judge or reward function, with the modules beside them that they import (their own
   package, a helper file in the same folder). What is installed (the standard library, site-packages) is not
   followed: every manifest records the versions of the libraries that computed it (:mod:`runtime.versions`).
2. Every first-party module a stage reaches is in its key, whatever its package: ``storage`` renders chat prompts
   and writes the shards, ``demo`` holds the gold rubric's word lists. There is no exemption for a module that
   only records (MLflow, progress): an edit there re-keys the stages of an unfinished iteration, a recomputation
   and never a stale reuse, and a rule with no exceptions cannot be wrong about one. Finished iterations never
   depend on keys (:mod:`campaign.history`).
3. Imports inside functions count too: the gold rubric a labeler imports lazily is code it runs.
4. ``from package import name`` counts the module ``package.name`` when it exists, else the package's
   ``__init__``.
5. A normalised tree is ``ast.dump`` text, which depends on the Python version's syntax tree (a new minor Python may
   change every key); that costs at most an unfinished iteration's stages.
6. Each file is parsed and normalised once per content (:func:`_parsed`): a command fingerprints every stage, and
   most of their closures are shared. What parsing gives (the normalised code's digest and the names the import
   statements may mean) is kept on disk too, in the user's cache (:func:`storage.files.cache_dir`), by the sha256 of
   the module's name, kind (package or not) and bytes, one file per Python build (its syntax trees are its own):
   parsing every stage's closure took each command about a second (issue 41). Which of those names are modules of
   our own is decided from the files, once per process, never kept on disk. An unreadable or damaged cache is parsed again; the
   cache is written once a command has fingerprinted its stages (:func:`pinned_code`).
7. A process computes with the code it imported when it started, and keys read the files when each stage starts:
   after an edit mid-campaign (a ``git pull``), a stage would be keyed with the new code and computed with the old.
   So a flow run fingerprints every stage when it starts (:func:`pinned_code`), and a file that reads otherwise
   later in that run is refused in one line (:class:`CodeChangedError`), before the stage computes anything.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import json
import site
import sys
import sysconfig
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.errors import UserError
from storage.files import cache_dir, write_text_replacing

_SOURCE_ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = tuple(
    sorted(
        path.parent.name for path in _SOURCE_ROOT.glob("*/__init__.py") if path.parent.name not in ("tests", "bench")
    )
)
"""The project's packages: every package of the repository but its tests and benchmarks."""


_pinned: dict[Path, bytes] | None = None
"""While a :func:`pinned_code` lasts: the sha256 of each source file as it first read then."""


class CodeChangedError(UserError, RuntimeError):
    """A source file a stage is keyed by changed on disk after the run started (choice 7)."""


@contextlib.contextmanager
def pinned_code(modules: Iterable[str]) -> Iterator[None]:
    """Fingerprint ``modules`` now, and until the block ends refuse any source file that reads otherwise than it first
    did in it (choice 7). Nested blocks share the outer one's record.

    Raises:
        CodeChangedError: on a later fingerprint, a file of its closure changed since.
    """
    global _pinned
    outer = _pinned
    _pinned = {} if outer is None else outer
    try:
        for module in modules:
            code_fingerprint(module)
        _save_cache()
        yield
    finally:
        _pinned = outer


_contents: dict[Path, tuple[tuple[int, int, int, int], bytes, bytes]] = {}
"""Each file read so far: its status (inode, size, modification and change times), bytes and sha256; a stage's key
reads its whole closure, so a command read each file about a hundred times (issue 41)."""


def _read(path: Path) -> bytes:
    """``path``'s bytes, refused if a :func:`pinned_code` block read them otherwise. Read again only where its
    status changed since it was last read (any write changes its change time)."""
    status = path.stat()
    signature = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    known = _contents.get(path)
    if known is None or known[0] != signature:
        data = path.read_bytes()
        known = _contents[path] = (signature, data, hashlib.sha256(data).digest())
    _, data, digest = known
    if _pinned is not None:
        if _pinned.setdefault(path, digest) != digest:
            raise CodeChangedError(
                f"{path} changed on disk while this run was going on: its stages would be keyed with the new code "
                "and computed with the code the run imported; run the command again"
            )
    return data


@functools.cache
def _installed_roots() -> tuple[Path, ...]:
    """The folders installed code lives in: the standard library and every site-packages."""
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return tuple(Path(root).resolve() for root in roots)


def _module_file(module: str) -> Path | None:
    """The source file of a module of our own code (choice 1), or None for anything else: a module that is
    installed, built in, not Python source, or not found."""
    if module.split(".")[0] in FIRST_PARTY:
        base = _SOURCE_ROOT.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None
    return _users_module_file(module)


@functools.lru_cache(maxsize=1024)
def _users_module_file(module: str) -> Path | None:
    """A module of a user's own code: its top-level package or module found on the path (``find_spec`` of a top-level
    name imports nothing), outside the installed folders, and the rest of the name followed as folders, so nothing is
    imported to find it (a submodule's ``find_spec`` would import its parents: torch, for ``torch.nn``)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if rest:
        bases = [Path(folder).joinpath(*rest) for folder in spec.submodule_search_locations or []]
        candidates = [path for base in bases for path in (base.with_suffix(".py"), base / "__init__.py")]
    else:
        candidates = [Path(spec.origin)] if spec.origin else []
    found = next((path.resolve() for path in candidates if path.suffix == ".py" and path.is_file()), None)
    if found is None or any(found.is_relative_to(root) for root in _installed_roots()):
        return None
    return found


Imported = tuple[tuple[str, str], ...]
"""What the import statements of a source name, each as ``(module, otherwise)``: the module ``import module`` or
``from package import name`` (``package.name``) means where it is one, else ``otherwise`` (``package``)."""


def _imported_names(package: str, tree: ast.Module) -> Imported:
    """:data:`Imported` of ``tree``, whose relative imports are relative to ``package`` ("" for a script)."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((alias.name, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            found.update((f"{base}.{alias.name}", base) for alias in node.names)
    return tuple(sorted(found))


@functools.lru_cache(maxsize=1024)
def _own_modules(imported: Imported) -> frozenset[str]:
    """The modules of our own code among ``imported`` (choices 1 and 4), as the files read first in this process."""
    found = {module if _module_file(module) else otherwise for module, otherwise in imported}
    return frozenset(name for name in found if _module_file(name) is not None)


_PARSING = threading.Lock()
"""``ast.parse`` one at a time here: CPython 3.11's AST constructor keeps its recursion depth in the interpreter's
state, not the thread's, and two threads building syntax trees at once fail with ``SystemError: AST constructor
recursion depth mismatch`` (a flow's stage threads fingerprint their stages in parallel)."""


def _parse(source: str | bytes) -> ast.Module:
    """``ast.parse(source)``, again when another thread's syntax tree (Prefect's, reading a flow's source) was built at
    the same moment: the check that failed is the constructor's own bookkeeping, and the tree is rebuilt whole."""
    with _PARSING:
        for _ in range(4):
            try:
                return ast.parse(source)
            except SystemError as error:
                if "recursion depth mismatch" not in str(error):
                    raise
        return ast.parse(source)


@functools.lru_cache(maxsize=256)
def normalised(source: str | bytes) -> str:
    """The code of ``source`` without what cannot change what it computes: its syntax tree as text, less every
    statement that is a lone string (docstrings of modules, classes, functions and attributes). Comments, blank
    lines and line numbers never reach the tree.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    return _without_docstrings(_parse(source))


class _Docstrings(ast.NodeTransformer):
    def visit_Expr(self, node: ast.Expr) -> ast.Expr | None:
        is_string = isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        return None if is_string else node


def _without_docstrings(tree: ast.Module) -> str:
    return ast.dump(_Docstrings().visit(tree))


@dataclass(frozen=True)
class _Parsed:
    """What a module's source gives its key: the sha256 of its normalised code, and what its imports name."""

    digest: bytes
    imported: Imported


_CACHE_LOCK = threading.Lock()
_cached: dict[str, list] | None = None
"""The parsed modules kept on disk (choice 6), by :func:`_cache_key`: ``[digest hex, imported]``; read once."""
_used: set[str] = set()
"""The keys of :data:`_cached` this process looked up."""
_unsaved = False
CACHE_ENTRIES = 4000
"""How many parsed modules the cache keeps at most (about 2 KB each): past that, only what the saving process used
(an edited module leaves its old versions behind)."""


def _cache_file() -> Path:
    build = hashlib.sha256(f"{sys.implementation.cache_tag} {sys.version}".encode()).hexdigest()[:16]
    return cache_dir() / "code" / f"parsed-{build}.json"


def _cache_key(module: str, is_package: bool, source: bytes) -> str:
    return hashlib.sha256(f"{module}\0{is_package}\0".encode() + source).hexdigest()


def _stored(value: object) -> _Parsed | None:
    """A cache entry as :class:`_Parsed`, or None where it is not one (a damaged file)."""
    try:
        digest, imported = value
        parsed = _Parsed(bytes.fromhex(digest), tuple((str(a), str(b)) for a, b in imported))
    except (TypeError, ValueError):
        return None
    return parsed if len(parsed.digest) == 32 else None


def _load_cache() -> dict[str, list]:
    try:
        loaded = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _save_cache() -> None:
    """Write what this process parsed into the cache file, beside what other processes wrote there meanwhile (at most
    :data:`CACHE_ENTRIES`); a cache that cannot be written is left as it is. Called once a command has fingerprinted
    every stage (:func:`pinned_code`)."""
    global _unsaved
    with _CACHE_LOCK:
        if not _unsaved:
            return
        merged = {**_load_cache(), **_cached}
        if len(merged) > CACHE_ENTRIES:
            merged = {key: _cached[key] for key in _used}
        try:
            _cache_file().parent.mkdir(parents=True, exist_ok=True)
            write_text_replacing(_cache_file(), json.dumps(merged, sort_keys=True))
        except OSError:
            pass
        _unsaved = False


@functools.lru_cache(maxsize=1024)
def _parsed(module: str, source: bytes) -> _Parsed:
    """:class:`_Parsed` of ``module``, whose text is ``source``: from the cache on disk, else parsed (choice 6)."""
    global _cached, _unsaved
    is_package = _module_file(module).name == "__init__.py"
    key = _cache_key(module, is_package, source)
    with _CACHE_LOCK:
        if _cached is None:
            _cached = _load_cache()
        _used.add(key)
        if (found := _stored(_cached.get(key))) is not None:
            return found
    tree = _parse(source)
    imported = _imported_names(module if is_package else module.rpartition(".")[0], tree)
    parsed = _Parsed(hashlib.sha256(_without_docstrings(tree).encode()).digest(), imported)
    with _CACHE_LOCK:
        _cached[key] = [parsed.digest.hex(), [list(pair) for pair in imported]]
        _unsaved = True
    return parsed


def _closure(module: str) -> dict[str, _Parsed]:
    """:class:`_Parsed` of ``module`` and of every module of our own code it imports, transitively, as their files
    read now (choice 6)."""
    if _module_file(module) is None:
        raise ValueError(f"cannot find module {module!r}, or it has no source file of its own to fingerprint")
    parsed: dict[str, _Parsed] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in parsed:
            continue
        parsed[name] = _parsed(name, _read(_module_file(name)))
        pending.extend(_own_modules(parsed[name].imported) - parsed.keys())
    return parsed


def code_closure(module: str) -> dict[str, str]:
    """The normalised code (:func:`normalised`) of ``module`` and of every module of our own code it imports,
    transitively (see the module docstring), by name.

    Raises:
        ValueError: ``module`` cannot be found, or is installed code.
    """
    return {name: normalised(_read(_module_file(name))) for name in _closure(module)}


def code_fingerprint(module: str) -> str:
    """sha256 over the normalised code a module computes with: its :func:`code_closure`, for a module of this project
    or a user's own (a judge or reward function, with the modules beside it that it imports).

    Raises:
        ValueError: the module cannot be found, or has no source file of its own (installed code).
    """
    digests = {name: parsed.digest for name, parsed in _closure(module).items()}
    digest = hashlib.sha256()
    for name in sorted(digests):
        digest.update(name.encode() + b"\0" + digests[name])
    return digest.hexdigest()


def script_fingerprint(path: str | Path) -> str:
    """sha256 over a script run as a file (the generation engine's server, which runs in an environment of its own):
    its normalised code and the :func:`code_fingerprint` of every module of our own code it imports.

    Raises:
        OSError: the file cannot be read.
        SyntaxError: it is not Python.
    """
    tree = _parse(_read(Path(path).resolve()))
    digest = hashlib.sha256(_without_docstrings(tree).encode())
    for name in sorted(_own_modules(_imported_names("", tree))):
        digest.update(name.encode() + b"\0" + code_fingerprint(name).encode())
    return digest.hexdigest()
