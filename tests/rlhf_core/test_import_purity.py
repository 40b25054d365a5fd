"""Importing rlhf_core (R1) pulls in no orchestration, tracking or file-format library, nor the outer layers."""

from __future__ import annotations

import subprocess
import sys

import rlhf_core

FORBIDDEN = ("prefect", "mlflow", "polars", "pyarrow", "storage", "runtime", "tasks", "campaign", "flows", "demo")


def test_importing_rlhf_core_and_every_submodule_loads_no_forbidden_module():
    modules = ["rlhf_core", *(f"rlhf_core.{name}" for name in rlhf_core.__all__)]
    script = "\n".join(
        [
            "import importlib, sys",
            f"for name in {modules!r}:",
            "    importlib.import_module(name)",
            f"forbidden = {FORBIDDEN!r}",
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in forbidden)",
            "print(','.join(loaded))",
        ]
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "", f"rlhf_core imported {result.stdout.strip()}"


def test_all_lists_every_module_of_the_package():
    from pathlib import Path

    on_disk = {path.stem for path in Path(rlhf_core.__file__).parent.glob("*.py") if path.stem != "__init__"}
    assert on_disk == set(rlhf_core.__all__)
