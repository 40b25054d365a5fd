"""Code fingerprints: a stage's key changes when the code that computes it changes, and only then."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import runtime.code
from runtime.code import COMPUTING, FIRST_PARTY, PLUMBING, code_closure, code_fingerprint, normalised


@pytest.fixture
def source_copy(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the project's packages that the fingerprints read instead of the real ones."""
    root = Path(runtime.code.__file__).resolve().parents[1]
    for package in FIRST_PARTY:
        shutil.copytree(root / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(runtime.code, "_SOURCE_ROOT", tmp_path)
    code_fingerprint.cache_clear()
    yield tmp_path
    code_fingerprint.cache_clear()


def test_the_closure_follows_imports_transitively_into_the_code_that_computes():
    closure = code_closure("tasks.compute_advantages")
    assert {"tasks.compute_advantages", "rlhf_core.gae", "rlhf_core.rewards", "rlhf_core.masked"} <= closure.keys()
    assert "tasks.rollout" not in closure and "campaign.config" not in closure  # only what it imports
    assert all(name == "tasks.compute_advantages" or name.split(".")[0] in COMPUTING for name in closure)
    assert not closure.keys() & {"storage.tracking", "storage.experience_io", "runtime.stage", *PLUMBING}


def test_the_ppo_update_closure_is_its_maths_not_its_plumbing():
    """The issue's count: 28 modules for a stage before, MLflow plumbing included."""
    closure = code_closure("tasks.ppo_update")
    assert "rlhf_core.ppo" in closure and "rlhf_core.losses" in closure
    assert not any(name.startswith(("storage.", "flows.")) for name in closure)


def test_editing_gae_changes_the_advantages_stage_and_not_the_sampler(source_copy: Path):
    before = {module: code_fingerprint(module) for module in ("tasks.compute_advantages", "tasks.sample_candidates")}
    gae = source_copy / "rlhf_core" / "gae.py"
    text = gae.read_text()
    maths = "torch.zeros_like(rewards[:, 0])"
    assert maths in text
    gae.write_text(text.replace(maths, "torch.full_like(rewards[:, 0], 0.5)"))  # a changed constant of the maths
    code_fingerprint.cache_clear()
    assert code_fingerprint("tasks.compute_advantages") != before["tasks.compute_advantages"]
    assert code_fingerprint("tasks.sample_candidates") == before["tasks.sample_candidates"]


def test_comments_docstrings_and_plumbing_keep_the_key(source_copy: Path):
    before = code_fingerprint("tasks.compute_advantages")
    gae = source_copy / "rlhf_core" / "gae.py"
    text = gae.read_text()
    first_def = text.index('    """', text.index("\ndef "))
    gae.write_text(
        "# a comment\n" + text[:first_def] + '    """An edited docstring."""\n    # note\n' + text[first_def:]
    )
    for plumbing in ("storage/tracking.py", "runtime/stage.py", "flows/console.py"):
        path = source_copy / plumbing
        path.write_text(path.read_text() + "\nCHANGED = 1\n")
    code_fingerprint.cache_clear()
    assert code_fingerprint("tasks.compute_advantages") == before


def test_normalised_code_ignores_docstrings_comments_and_layout_but_not_constants():
    one = 'def f(x):\n    """Doc."""\n    return x * 0.99  # gamma\n\nLIMIT = 3\n"""The limit."""\n'
    two = "def f(x):\n\n    return x*0.99\nLIMIT = 3\n"
    assert normalised(one) == normalised(two)
    assert normalised(two) != normalised(two.replace("0.99", "0.98"))


def test_a_module_outside_the_project_is_fingerprinted_by_its_own_file(tmp_path: Path, monkeypatch):
    (tmp_path / "my_rubric.py").write_text("def score(prompt, response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_fingerprint("my_rubric")
    (tmp_path / "my_rubric.py").write_text("def score(prompt, response):\n    return 2.0\n")
    code_fingerprint.cache_clear()
    assert code_fingerprint("my_rubric") != first
    with pytest.raises(ValueError, match="cannot find module|no source file"):
        code_fingerprint("no_such_module_anywhere")
