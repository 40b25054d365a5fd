"""A campaign is history: edits of the code or of an input file never recompute a finished iteration.

The tests tell one story, in order, on one campaign (each checks where the one before left it), on the session's
Prefect server and a real SQLite MLflow store. The code is a copy of the project's packages in ``tmp_path`` that
the test edits as a developer would (a comment, a docstring, a log message, the maths of GAE). Each ``rlhf`` command
runs in the test's process (:func:`flows.cli.main`), its code fingerprints read from the copy
(``runtime.code._SOURCE_ROOT``, as tests/runtime/test_code.py does). Two commands run in a subprocess, where the
process is what is tested: one that imports the copy, whose fingerprints must then read the files it imported, and a
refusal, which must end with exit code 2 and one line on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import runtime.code
from flows.cli import main
from runtime.code import FIRST_PARTY

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def project(prefect_server, checkpoint_world, tmp_path_factory):
    """A copy of the project (its packages and configs) whose code the fingerprints read, a finished one-iteration
    campaign, and the arguments that run ``rlhf`` on it."""
    source = tmp_path_factory.mktemp("project")
    for package in (*FIRST_PARTY, "configs"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run_root = tmp_path_factory.mktemp("runs")
    inputs = tmp_path_factory.mktemp("inputs")  # a copy: a test edits the prompts in place
    shutil.copytree(checkpoint_world["policy"], inputs / "policy")
    for name in ("prompts", "eval_prompts"):
        shutil.copy(checkpoint_world[name], inputs / f"{name}.jsonl")
    world = [
        f"run_root={run_root}",
        f"model.policy={inputs / 'policy'}",
        *(f"data.{name}={inputs / f'{name}.jsonl'}" for name in ("prompts", "eval_prompts")),
    ]

    def arguments(*command: str, overrides: tuple[str, ...] = ()) -> list[str]:
        sets = [f"--set={o}" for o in (*world, "iterations=1", *overrides)]
        return [*command, "--config", str(source / "configs" / "tiny.yaml"), *sets]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime.code, "_SOURCE_ROOT", source)
        assert main(arguments("run")) == 0
        yield source, run_root, arguments, inputs


def _rlhf(project, capfd, *command: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``rlhf <command>`` in this process: its exit code and what it printed."""
    _, _, arguments, _ = project
    argv = arguments(*command, overrides=overrides)
    capfd.readouterr()
    code = main(argv)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def _rlhf_in_a_process(project, *command: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``rlhf <command>`` in a process of its own that imports the copy of the project, on the session's Prefect
    server."""
    from prefect.settings import PREFECT_API_URL

    source, _, arguments, _ = project
    env = {**os.environ, "PYTHONPATH": str(source), "PREFECT_API_URL": PREFECT_API_URL.value()}
    argv = [sys.executable, "-m", "flows", *arguments(*command, overrides=overrides)]
    return subprocess.run(argv, cwd=source, env=env, capture_output=True, text=True, timeout=600)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}"
    path.write_text(text.replace(old, new, 1))


def _iteration_runs(run_root: Path) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.kind` = 'iteration'")
    return sorted(runs, key=lambda run: (int(run.data.tags["rlhf.iteration"]), run.info.start_time))


def _outputs(run_root: Path, stage: str) -> int:
    return len(list((run_root / "tiny" / stage).glob("*/_manifest.json")))


def _notices(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if "computed with" in line]


def test_comment_and_docstring_edits_anywhere_and_orchestration_edits_re_run_nothing(project, capfd):
    """Comments and docstrings never reach a fingerprint; the orchestration (flows) is not code that computes. A log
    message of the stage mechanism (runtime) is code: runtime computes (see runtime/code.py)."""
    source, run_root, _, _ = project
    before = [run.info.run_id for run in _iteration_runs(run_root)]
    _edit(source / "storage" / "tracking.py", '"""', '# an edited comment\n"""')
    _edit(source / "rlhf_core" / "gae.py", "    Naive equivalent", "    A naive equivalent, edited")
    _edit(
        source / "runtime" / "stage.py",
        "    # Every stage sets its own thread count",
        "    # Each stage sets its thread count",
    )
    _edit(source / "flows" / "concurrency.py", 'another iteration or "', 'another iteration, or "')
    _edit(source / "flows" / "rlhf_pipeline.py", '"""The RLHF flows', '"""The RLHF flows (edited)')
    done = _rlhf(project, capfd, "run")
    assert done.returncode == 0, done.stderr
    assert "all 1 iterations are finished; nothing to run" in done.stdout
    assert not _notices(done)  # nothing that computes differs
    assert [run.info.run_id for run in _iteration_runs(run_root)] == before


def test_a_maths_edit_keeps_the_finished_iterations_the_next_one_uses_it_and_says_so(project, capfd):
    """The command that finds the campaign finished runs in a process importing the edited copy: what it imports is
    what its fingerprints read."""
    source, run_root, _, _ = project
    before = _iteration_runs(run_root)
    advantages = _outputs(run_root, "compute_advantages")
    _edit(
        source / "rlhf_core" / "gae.py", "last_advantage = torch.zeros_like(", "last_advantage = 0.0 * torch.ones_like("
    )

    finished = _rlhf_in_a_process(project, "run")  # finished: nothing recomputed, and it says what differs
    assert finished.returncode == 0, finished.stderr
    assert "nothing to run" in finished.stdout
    assert "iteration 0 was computed with other code" in finished.stdout

    more = _rlhf(project, capfd, "run", overrides=("iterations=2",))
    assert more.returncode == 0, more.stderr
    notices = _notices(more)
    assert len(notices) == 1 and "iteration 1 on use what is here now" in notices[0], more.stderr
    after = _iteration_runs(run_root)
    assert [run.info.run_id for run in after[:1]] == [run.info.run_id for run in before]
    assert [int(run.data.tags["rlhf.iteration"]) for run in after] == [0, 1]
    assert _outputs(run_root, "compute_advantages") == advantages + 1  # iteration 1's, by the edited maths
    assert after[1].data.tags["rlhf.code"] != after[0].data.tags["rlhf.code"]
    assert after[1].data.tags["rlhf.package_version"] == after[0].data.tags["rlhf.package_version"]


def test_from_iteration_recomputes_from_there_and_keeps_the_old_runs_superseded(project, capfd):
    _, run_root, _, _ = project
    before = _iteration_runs(run_root)
    assert len(before) == 2, "after the maths edit, two finished iterations"

    refused = _rlhf(project, capfd, "run", "--from-iteration", "1", overrides=("iterations=2",))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "rlhf: --from-iteration 1 continues iteration 0, whose optimizer states were pruned (only the newest "
        "finished iteration keeps them): recompute from --from-iteration 0, or leave --from-iteration out to continue "
        "the campaign"
    ]

    done = _rlhf(project, capfd, "run", "--from-iteration", "0")
    assert done.returncode == 0, done.stderr
    after = _iteration_runs(run_root)
    old, new = after[:1] + after[2:], after[1]
    assert [run.info.run_id for run in old] == [run.info.run_id for run in before]
    assert all(run.data.tags["rlhf.superseded_by"] == new.info.run_id for run in old)
    assert new.data.tags["rlhf.iteration"] == "0" and "rlhf.superseded_by" not in new.data.tags
    assert new.data.tags["rlhf.code"] == before[1].data.tags["rlhf.code"]  # this code, the edited maths
    again = _rlhf(project, capfd, "run")
    assert "nothing to run" in again.stdout and not _notices(again)


def test_an_input_file_edited_in_place_is_named_and_used_from_the_next_iteration(project, capfd):
    """The issue's imported-preference-file case, on a prompt file: a finished iteration is kept and the file
    whose content differs is named; the next iteration reads the new content. (Before, a finished campaign
    recomputed every stage for an edited prompt file, and silently reused a stale imported preference file.)"""
    _, run_root, _, inputs = project
    before = _iteration_runs(run_root)
    current = [run for run in before if "rlhf.superseded_by" not in run.data.tags]
    assert [run.data.tags["rlhf.iteration"] for run in current] == ["0"], "after --from-iteration 0, one iteration"
    prompts = inputs / "prompts.jsonl"
    prompts.write_text(prompts.read_text().replace("the", "eht", 1))  # same size, same inode
    rollouts = _outputs(run_root, "rollout")

    finished = _rlhf(project, capfd, "run")
    assert finished.returncode == 0, finished.stderr
    assert "nothing to run" in finished.stdout
    assert "iteration 0 was computed with another content of `data.prompts`" in finished.stdout

    more = _rlhf(project, capfd, "run", overrides=("iterations=2",))
    assert more.returncode == 0, more.stderr
    after = [run for run in _iteration_runs(run_root) if "rlhf.superseded_by" not in run.data.tags]
    assert [run.info.run_id for run in after[:1]] == [current[0].info.run_id]
    assert _outputs(run_root, "rollout") == rollouts + 1
    recorded = [json.loads(run.data.tags["rlhf.inputs"])["data.prompts"] for run in after]
    assert recorded[0] != recorded[1]


def test_issue32_a_library_upgrade_is_said_in_one_line_and_a_run_without_versions_says_nothing(project, capfd):
    """Every iteration run records the library versions that computed it (`rlhf.versions`). The story's iteration 0
    is made to have been computed by an older torch, and iteration 1 by a release that recorded no versions: the next
    iteration is computed, and its one notice names torch only, for both iterations."""
    from mlflow import MlflowClient

    _, run_root, _, _ = project
    current = [run for run in _iteration_runs(run_root) if "rlhf.superseded_by" not in run.data.tags]
    assert [run.data.tags["rlhf.iteration"] for run in current] == ["0", "1"], "after the edited prompt file, two"
    recorded = json.loads(current[0].data.tags["rlhf.versions"])
    assert {"python", "torch", "transformers", "peft", "accelerate"} <= set(recorded)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_root / 'mlflow.db'}")
    client.set_tag(current[0].info.run_id, "rlhf.versions", json.dumps({**recorded, "torch": "2.0.0"}))
    client.delete_tag(current[1].info.run_id, "rlhf.versions")

    more = _rlhf(project, capfd, "run", overrides=("iterations=3",))
    assert more.returncode == 0, more.stderr
    notices = _notices(more)
    assert len(notices) == 1, more.stderr
    assert (
        f"iterations 0-1 were computed with other library versions (torch 2.0.0 there, {recorded['torch']} here)"
        in (notices[0])
    )
    assert "iteration 2 on use what is here now" in notices[0]
