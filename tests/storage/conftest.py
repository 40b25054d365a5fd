"""Storage fixtures: a run layout per test and a pre-migrated MLflow SQLite store copied per test.

Creating and migrating a fresh MLflow database takes seconds; copying a migrated one takes
milliseconds (the trick from fmind/mlops-python-package PR #129). Every test still gets its own
store under its own ``tmp_path``; nothing touches the user's MLflow database.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from storage.layout import RunLayout


@pytest.fixture(scope="session")
def migrated_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, fully migrated MLflow SQLite database (created once per session)."""
    from storage.mlflow_store import MlflowStore

    layout = RunLayout(tmp_path_factory.mktemp("mlflow-template"))
    MlflowStore(layout.tracking_uri())
    return layout.mlflow_db()


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout(tmp_path / "run")


@pytest.fixture
def store(layout: RunLayout, migrated_mlflow_db: Path):
    """An MlflowStore on a private copy of the migrated store, artifacts under the test's run root."""
    from storage.mlflow_store import MlflowStore

    layout.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_mlflow_db, layout.mlflow_db())
    return MlflowStore(layout.tracking_uri(), artifact_root=layout.artifact_root())


@pytest.fixture
def tracker(layout: RunLayout, migrated_mlflow_db: Path):
    """A Tracker on a private copy of the migrated store, artifacts under the test's run root."""
    from storage.tracking import Tracker

    layout.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_mlflow_db, layout.mlflow_db())
    return Tracker(layout.tracking_uri(), artifact_root=layout.artifact_root())


@pytest.fixture
def uploading_tracker(layout: RunLayout, migrated_mlflow_db: Path):
    """The same store, uploading stage outputs as artifacts the way a tracking server gets them."""
    from storage.tracking import Tracker

    layout.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_mlflow_db, layout.mlflow_db())
    return Tracker(layout.tracking_uri(), artifact_root=layout.artifact_root(), outputs_by_reference=False)
