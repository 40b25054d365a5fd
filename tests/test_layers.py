"""Imports go one way: flows -> tasks -> {storage, rlhf_core}; storage -> rlhf_core (types only).

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
    "tasks": {"tasks", "storage", "rlhf_core"},
    "demo": {"demo", "rlhf_core"},
    "flows": {"flows", "tasks", "storage", "rlhf_core", "demo"},
}
FIRST_PARTY = set(MAY_IMPORT)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names & FIRST_PARTY


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_no_layer_imports_a_layer_above_it(layer):
    breaks = {
        str(path.relative_to(ROOT)): sorted(_imports(path) - MAY_IMPORT[layer])
        for path in sorted((ROOT / layer).rglob("*.py"))
        if _imports(path) - MAY_IMPORT[layer]
    }
    assert not breaks, f"imports running back up: {breaks}"
