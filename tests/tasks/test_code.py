"""Code fingerprints: a stage's key changes when code it runs changes, and only then."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tasks.code
from tasks.code import FIRST_PARTY, code_closure, code_fingerprint


@pytest.fixture
def source_copy(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the project's packages that the fingerprints read instead of the real ones."""
    root = Path(tasks.code.__file__).resolve().parents[1]
    for package in FIRST_PARTY:
        shutil.copytree(root / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(tasks.code, "_SOURCE_ROOT", tmp_path)
    code_fingerprint.cache_clear()
    yield tmp_path
    code_fingerprint.cache_clear()


def test_the_closure_follows_imports_transitively_and_stays_in_the_project():
    closure = code_closure("tasks.compute_advantages")
    assert {"tasks.compute_advantages", "rlhf_core.gae", "rlhf_core.rewards", "storage.experience_io"} <= closure.keys()
    assert "tasks.rollout" not in closure and "flows.config" not in closure  # only what it imports
    assert all(name.split(".")[0] in FIRST_PARTY for name in closure)


def test_editing_gae_changes_the_advantages_stage_and_not_the_sampler(source_copy: Path):
    before = {module: code_fingerprint(module) for module in ("tasks.compute_advantages", "tasks.sample_candidates")}
    gae = source_copy / "rlhf_core" / "gae.py"
    gae.write_text(gae.read_text() + "\n# an edit\n")
    code_fingerprint.cache_clear()
    assert code_fingerprint("tasks.compute_advantages") != before["tasks.compute_advantages"]
    assert code_fingerprint("tasks.sample_candidates") == before["tasks.sample_candidates"]


def test_a_module_outside_the_project_is_fingerprinted_by_its_own_file(tmp_path: Path, monkeypatch):
    (tmp_path / "my_rubric.py").write_text("def score(prompt, response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_fingerprint("my_rubric")
    (tmp_path / "my_rubric.py").write_text("def score(prompt, response):\n    return 2.0\n")
    code_fingerprint.cache_clear()
    assert code_fingerprint("my_rubric") != first
    with pytest.raises(ValueError, match="cannot find module|no source file"):
        code_fingerprint("no_such_module_anywhere")
