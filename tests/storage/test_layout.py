"""RunLayout: absolute, deterministic, content-addressed paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.layout import RunLayout

KEY_A = "a" * 64
KEY_B = "a" * 15 + "b" + "a" * 48


def test_root_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    layout = RunLayout(Path("runs"))
    assert layout.root == tmp_path.resolve() / "runs"
    os.chdir("/")  # later working-directory changes do not move anything
    assert layout.stage_dir("rollout", KEY_A) == tmp_path.resolve() / "runs" / "rollout" / KEY_A[:16]


def test_paths(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    root = tmp_path.resolve()
    assert layout.mlflow_db() == root / "mlflow.db"
    assert layout.artifact_root() == root / "mlartifacts"
    assert layout.cache_dir() == root / "cache"
    assert layout.tracking_uri() == f"sqlite:///{root}/mlflow.db"


def test_stage_dirs_are_deterministic_and_collision_free(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    assert layout.stage_dir("rollout", KEY_A) == RunLayout(tmp_path).stage_dir("rollout", KEY_A)
    assert layout.stage_dir("rollout", KEY_A) != layout.stage_dir("rollout", KEY_B)
    assert layout.stage_dir("rollout", KEY_A) != layout.stage_dir("ppo_update", KEY_A)
    assert layout.stage_dir("rollout", KEY_A).is_relative_to(layout.root)


@pytest.mark.parametrize("stage", ["", "../up", "a/b", ".hidden"])
def test_bad_stage_names_are_refused(tmp_path: Path, stage: str) -> None:
    with pytest.raises(ValueError, match="stage"):
        RunLayout(tmp_path).stage_dir(stage, KEY_A)


@pytest.mark.parametrize("key", ["short", "Z" * 64, "../" * 20])
def test_bad_keys_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="input_key"):
        RunLayout(tmp_path).stage_dir("rollout", key)


def test_layout_is_frozen(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    with pytest.raises(AttributeError):
        layout.root = Path("/elsewhere")  # type: ignore[misc]
