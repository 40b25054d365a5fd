"""Code fingerprints: a hash of the source a stage runs, part of its input key.

A stage's output depends on its code as much as on its settings: editing ``rlhf_core/gae.py``
must re-run the advantages, not reuse what the old code wrote. The fingerprint of a module is the
sha256 of the source of every first-party module it imports, directly or through others (found
by reading the import statements, without importing anything).

Choices:
1. First party means this project's packages (:data:`FIRST_PARTY`); a change in an installed
   library (torch, transformers) is not seen. Its version is recorded beside each run instead.
2. Imports inside functions count too: the gold rubric a labeler imports lazily is code it runs.
3. ``from package import name`` counts the module ``package.name`` when it exists, else the
   package's ``__init__``.
4. A module outside the project (a user's judge or reward function) is fingerprinted by its own
   source file.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path

FIRST_PARTY = ("rlhf_core", "storage", "tasks", "flows", "demo")
_SOURCE_ROOT = Path(__file__).resolve().parents[1]


def _module_file(module: str) -> Path | None:
    """The source file of a first-party module, or None for anything else."""
    if module.split(".")[0] not in FIRST_PARTY:
        return None
    base = _SOURCE_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(module: str, source: str) -> set[str]:
    """First-party modules named by the import statements of ``source``."""
    is_package = _module_file(module).name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
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


def code_closure(module: str) -> dict[str, bytes]:
    """The sources of ``module`` and of every first-party module it imports, transitively, by name.

    Raises:
        ValueError: ``module`` is not a first-party module with a source file.
    """
    if _module_file(module) is None:
        raise ValueError(f"{module!r} is not a module of this project ({', '.join(FIRST_PARTY)})")
    sources: dict[str, bytes] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in sources:
            continue
        sources[name] = _module_file(name).read_bytes()
        pending.extend(_imported_modules(name, sources[name].decode("utf-8")) - sources.keys())
    return sources


@functools.cache
def code_fingerprint(module: str) -> str:
    """sha256 over the sources a module runs: for a first-party module, its :func:`code_closure`; for
    any other (a user's judge or reward function), its own source file.

    Raises:
        ValueError: the module cannot be found, or has no source file.
    """
    if _module_file(module) is not None:
        sources = code_closure(module)
    else:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as error:
            raise ValueError(f"cannot find module {module!r}: {error}") from error
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise ValueError(f"module {module!r} has no source file to fingerprint")
        sources = {module: Path(spec.origin).read_bytes()}
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + hashlib.sha256(sources[name]).digest())
    return digest.hexdigest()
