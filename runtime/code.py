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
   most of their closures are shared.
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
import site
import sysconfig
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.errors import UserError

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


def _imported_modules(module: str, tree: ast.Module) -> set[str]:
    """The modules of our own code named by the import statements of ``tree`` (the source of ``module``)."""
    is_package = _module_file(module).name == "__init__.py"
    return _own_imports(module if is_package else module.rpartition(".")[0], tree)


def _own_imports(package: str, tree: ast.Module) -> set[str]:
    """The modules of our own code named by the import statements of ``tree``, whose relative imports are relative to
    ``package`` ("" for a script)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if _module_file(submodule) else base)
    return {name for name in found if _module_file(name) is not None}


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
    """A module's normalised code, its digest, and the first-party modules it imports."""

    code: str
    digest: bytes
    imports: frozenset[str]


@functools.lru_cache(maxsize=1024)
def _parsed(module: str, source: bytes) -> _Parsed:
    """:class:`_Parsed` of ``module``, whose text is ``source``."""
    tree = _parse(source)
    imports = frozenset(_imported_modules(module, tree))
    code = _without_docstrings(tree)
    return _Parsed(code, hashlib.sha256(code.encode()).digest(), imports)


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
        pending.extend(parsed[name].imports - parsed.keys())
    return parsed


def code_closure(module: str) -> dict[str, str]:
    """The normalised code (:func:`normalised`) of ``module`` and of every module of our own code it imports,
    transitively (see the module docstring), by name.

    Raises:
        ValueError: ``module`` cannot be found, or is installed code.
    """
    return {name: parsed.code for name, parsed in _closure(module).items()}


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
    for name in sorted(_own_imports("", tree)):
        digest.update(name.encode() + b"\0" + code_fingerprint(name).encode())
    return digest.hexdigest()
