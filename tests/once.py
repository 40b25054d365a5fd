"""What a test run builds once, whichever process asks first: under pytest-xdist each worker is a process of its own,
and a session fixture runs once per worker, so what both workers need (a finished campaign, a launch of 2 training
processes) is built in a folder they both see, under a lock (docs/testing.md)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

FINISHED = ".finished"  # written last in a shared folder: what is there is whole


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test run's folder that every test process sees: the base temporary folder, or under pytest-xdist the
    folder holding each worker's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The shared folder ``name``, filled by ``build(folder)`` in the first process that asks for it; the others wait
    for it to finish. A build that failed left no ``.finished`` mark: the next process to ask starts it again."""
    shared = shared_folder(tmp_path_factory)
    folder = shared / name
    with FileLock(shared / f"{name}.lock"):
        if not (folder / FINISHED).exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / FINISHED).touch()
    return folder
