"""Imports go one way, from the top floor down, and no layer imports one above it:

    flows -> campaign -> tasks -> runtime -> storage -> rlhf_core

``demo`` (the embedded world) reads the core only; ``rlhf_envs`` (the ecosystems' adapters, user code the config names)
imports nothing of the project; ``engine_server`` (the generation engine's server, run in an
environment of its own) imports nothing of the project. ``campaign`` (the campaign model) imports neither Prefect nor
torch (``test_the_campaign_model_imports_neither_prefect_nor_torch``). MLflow sits behind one adapter,
``storage/mlflow_store.py``, the only module of the project that imports it
(``test_one_module_imports_each_wrapped_library``; ``bench/`` is no layer and keeps its own use).

Read from the source (every import statement, inside functions too), so a lazy import cannot hide
a layering break. ``rlhf_core`` also imports none of the libraries of the outer layers
(``tests/rlhf_core/test_import_purity.py`` checks that by importing it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAY_IMPORT = {
    "rlhf_core": {"rlhf_core"},
    "storage": {"storage", "rlhf_core"},
    "runtime": {"runtime", "storage", "rlhf_core"},
    "tasks": {"tasks", "runtime", "storage", "rlhf_core"},
    "demo": {"demo", "rlhf_core"},
    "campaign": {"campaign", "tasks", "runtime", "storage", "rlhf_core", "demo"},
    "flows": {"flows", "campaign", "tasks", "runtime", "storage", "rlhf_core", "demo"},
    "engine_server": {"engine_server"},
    "rlhf_envs": {"rlhf_envs"},
}
FIRST_PARTY = set(MAY_IMPORT)
WRAPPED = {"mlflow": "storage/mlflow_store.py"}
"""Libraries behind an adapter: the one module of the project that may import each."""


def _imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (first-party and third-party)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module]
        else:
            continue
        names.update(module.split(".")[0] for module in modules)
    return names


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_no_layer_imports_a_layer_above_it(layer):
    breaks = {
        str(path.relative_to(ROOT)): sorted((_imports(path) & FIRST_PARTY) - MAY_IMPORT[layer])
        for path in sorted((ROOT / layer).rglob("*.py"))
        if (_imports(path) & FIRST_PARTY) - MAY_IMPORT[layer]
    }
    assert not breaks, f"imports running back up: {breaks}"


@pytest.mark.parametrize("library", sorted(WRAPPED))
def test_one_module_imports_each_wrapped_library(library):
    """Everything else reaches the library through that module, in the project's own terms."""
    importers = [
        str(path.relative_to(ROOT))
        for layer in sorted(FIRST_PARTY)
        for path in sorted((ROOT / layer).rglob("*.py"))
        if library in _imports(path)
    ]
    assert importers == [WRAPPED[library]], f"{library} imported outside its adapter: {importers}"


def test_the_campaign_model_imports_neither_prefect_nor_torch():
    """What lets a command that only reads a campaign start in seconds (imported, not read: a lazy import counts
    only when it runs, and none of the campaign model's modules needs Prefect or torch at all)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys, pkgutil, importlib, campaign\n"
        "for m in pkgutil.iter_modules(campaign.__path__): importlib.import_module('campaign.' + m.name)\n"
        "print(json.dumps(sorted({'prefect', 'torch', 'transformers'} & set(sys.modules))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(done.stdout.splitlines()[-1]) == []
