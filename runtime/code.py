"""Code fingerprints: a hash of the code that computes a stage's output, part of its input key.

A stage's output depends on its code as much as on its settings: editing the maths of
``rlhf_core/gae.py`` must re-run the advantages of an unfinished iteration, not reuse what the old
code wrote. Editing a comment, a docstring, MLflow plumbing or the console must not. So the
fingerprint of a stage module covers the code that computes (the module itself, and the
:data:`COMPUTING` modules it imports, directly or through others, found by reading the import
statements without importing anything), each *normalised*: its syntax tree without docstrings
(comments and layout never reach the tree).

Choices:
1. What computes is ``rlhf_core`` (models, maths, generation, training loops) and the tasks' own
   helpers that shape data (``tasks.text``, ``tasks.tensors``, ``tasks.labelers``); not ``storage`` (bytes on disk:
   its contract is ``SCHEMA_VERSION``, part of every key), ``flows`` (orchestration, console) nor
   the tasks' plumbing (:data:`PLUMBING`: the stage mechanism, context, launch and fan-out). A change
   in an installed library (torch, transformers) is not seen; its version is recorded in every stage manifest
   and iteration run (:mod:`runtime.versions`).
2. Imports inside functions count too: the gold rubric a labeler imports lazily is code it runs.
3. ``from package import name`` counts the module ``package.name`` when it exists, else the
   package's ``__init__``.
4. A module outside the project (a user's judge or reward function) is fingerprinted by its own
   source, normalised the same way.
5. A normalised tree is ``ast.dump`` text, which depends on the Python version's syntax tree (a
   new minor Python may change every key); finished iterations never depend on keys
   (:mod:`flows.rlhf_pipeline`), so that costs at most an unfinished iteration's stages.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = tuple(
    sorted(
        path.parent.name for path in _SOURCE_ROOT.glob("*/__init__.py") if path.parent.name not in ("tests", "bench")
    )
)
"""The project's packages: every package of the repository but its tests and benchmarks."""
COMPUTING = ("rlhf_core", "tasks")
"""The packages whose modules a fingerprint follows into (less :data:`PLUMBING`)."""
PLUMBING = ("tasks.reward_function",)
"""Modules of the computing packages that decide where and whether code runs, not what it computes. A reward
function is fingerprinted by its own module (:class:`runtime.references.RewardFunctionReference`), not by the loader."""


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
    return module.split(".")[0] in COMPUTING and module not in PLUMBING


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


def code_closure(module: str) -> dict[str, str]:
    """The normalised code (:func:`normalised`) of ``module`` and of every computing module it imports,
    transitively (see the module docstring), by name.

    Raises:
        ValueError: ``module`` is not a first-party module with a source file.
    """
    if _module_file(module) is None:
        raise ValueError(f"{module!r} is not a module of this project ({', '.join(FIRST_PARTY)})")
    code: dict[str, str] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in code:
            continue
        tree = ast.parse(_module_file(name).read_bytes())
        imported = _imported_modules(name, tree)
        code[name] = _without_docstrings(tree)
        pending.extend(found for found in imported - code.keys() if _computes(found))
    return code


@functools.cache
def code_fingerprint(module: str) -> str:
    """sha256 over the normalised code a module computes with: for a first-party module, its
    :func:`code_closure`; for any other (a user's judge or reward function), its own source file.

    Raises:
        ValueError: the module cannot be found, or has no source file.
    """
    if _module_file(module) is not None:
        code = code_closure(module)
    else:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as error:
            raise ValueError(f"cannot find module {module!r}: {error}") from error
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise ValueError(f"module {module!r} has no source file to fingerprint")
        code = {module: normalised(Path(spec.origin).read_bytes())}
    digest = hashlib.sha256()
    for name in sorted(code):
        digest.update(name.encode() + b"\0" + hashlib.sha256(code[name].encode()).digest())
    return digest.hexdigest()
