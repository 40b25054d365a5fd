"""Code fingerprints: a hash of the code that computes a stage's output, part of its input key.

A stage's output depends on its code as much as on its settings: editing the maths of ``rlhf_core/gae.py``, the
seed derivation or how a model is loaded must re-run the stages of an unfinished iteration that ran it, not reuse
what the old code wrote. Editing a comment, a docstring or the layout must not. So the fingerprint of a stage
covers what runs it: its module and every module of the :data:`COMPUTING` packages that module imports, directly or
through others (found by reading the import statements, without importing anything), each *normalised*: its
syntax tree without docstrings (comments and layout never reach the tree). A stage that samples on the vLLM engine
adds the engine's server and identity (:mod:`runtime.engine`).

Choices:
1. What computes is a package's role, said once here, not a list of modules: ``rlhf_core`` (models, maths,
   generation, training loops), ``runtime`` (how a stage runs: the seed derivation, model loading, fan-out and
   launch, the engine's client) and ``tasks`` (the stages, what a reward function is called with). Not ``storage``
   (bytes on disk: its contract is ``SCHEMA_VERSION``, part of every key), ``campaign`` and ``flows`` (they decide
   which stages run and hand each its settings, which are keyed) nor ``demo`` (an input, keyed by its files'
   content). So an edit to the stage mechanism itself (its MLflow record, say) re-keys an unfinished iteration's
   stages: a recomputation, never a stale reuse. A change in an installed library is not seen here: every manifest
   records the versions of the libraries that computed it (:mod:`runtime.versions`).
2. Imports inside functions count too: the gold rubric a labeler imports lazily is code it runs.
3. ``from package import name`` counts the module ``package.name`` when it exists, else the package's
   ``__init__``.
4. A module outside the project (a user's judge or reward function) is fingerprinted by its own source, normalised
   the same way.
5. A normalised tree is ``ast.dump`` text, which depends on the Python version's syntax tree (a new minor Python may
   change every key); finished iterations never depend on keys (:mod:`campaign.history`), so that costs at most an
   unfinished iteration's stages.
6. Each file is parsed and normalised once per content (:func:`_module_code`): a command fingerprints every stage,
   and most of their closures are shared.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = tuple(
    sorted(
        path.parent.name for path in _SOURCE_ROOT.glob("*/__init__.py") if path.parent.name not in ("tests", "bench")
    )
)
"""The project's packages: every package of the repository but its tests and benchmarks."""
COMPUTING = ("rlhf_core", "runtime", "tasks")
"""The packages whose modules a fingerprint follows into (choice 1)."""


def _module_file(module: str) -> Path | None:
    """The source file of a first-party module, or None for anything else."""
    if module.split(".")[0] not in FIRST_PARTY:
        return None
    base = _SOURCE_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _computes(module: str) -> bool:
    return module.split(".")[0] in COMPUTING


def _imported_modules(module: str, tree: ast.Module) -> set[str]:
    """First-party modules named by the import statements of ``tree`` (the source of ``module``)."""
    is_package = _module_file(module).name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
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


def normalised(source: str | bytes) -> str:
    """The code of ``source`` without what cannot change what it computes: its syntax tree as text, less every
    statement that is a lone string (docstrings of modules, classes, functions and attributes). Comments, blank
    lines and line numbers never reach the tree.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    return _without_docstrings(ast.parse(source))


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
    tree = ast.parse(source)
    imports = frozenset(_imported_modules(module, tree))
    code = _without_docstrings(tree)
    return _Parsed(code, hashlib.sha256(code.encode()).digest(), imports)


def _closure(module: str) -> dict[str, _Parsed]:
    """:class:`_Parsed` of ``module`` and of every computing module it imports, transitively, as their files read now
    (choice 6)."""
    if _module_file(module) is None:
        raise ValueError(f"{module!r} is not a module of this project ({', '.join(FIRST_PARTY)})")
    parsed: dict[str, _Parsed] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in parsed:
            continue
        parsed[name] = _parsed(name, _module_file(name).read_bytes())
        pending.extend(found for found in parsed[name].imports - parsed.keys() if _computes(found))
    return parsed


def code_closure(module: str) -> dict[str, str]:
    """The normalised code (:func:`normalised`) of ``module`` and of every computing module it imports,
    transitively (see the module docstring), by name.

    Raises:
        ValueError: ``module`` is not a first-party module with a source file.
    """
    return {name: parsed.code for name, parsed in _closure(module).items()}


def code_fingerprint(module: str) -> str:
    """sha256 over the normalised code a module computes with: for a first-party module, its
    :func:`code_closure`; for any other (a user's judge or reward function), its own source file.

    Raises:
        ValueError: the module cannot be found, or has no source file.
    """
    if _module_file(module) is not None:
        digests = {name: parsed.digest for name, parsed in _closure(module).items()}
    else:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as error:
            raise ValueError(f"cannot find module {module!r}: {error}") from error
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise ValueError(f"module {module!r} has no source file to fingerprint")
        digests = {module: hashlib.sha256(normalised(Path(spec.origin).read_bytes()).encode()).digest()}
    digest = hashlib.sha256()
    for name in sorted(digests):
        digest.update(name.encode() + b"\0" + digests[name])
    return digest.hexdigest()
