"""A campaign recorded by the previous release opens and continues with this one (issue 34): no logged models, no
Prefect assets, actor versions registered without a model; `rlhf run` keeps its finished iteration as it is, runs
the next one with logged models and events, ranks only what was evaluated with a model, and `rlhf compare` reads
both (slow: two `rlhf run` commands, the first from the previous release's source, taken from git).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE = "027b852"
"""main before issue 34: the layout every campaign recorded until now has."""

pytestmark = pytest.mark.slow


def _previous_release(destination: Path) -> Path:
    found = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS_RELEASE], capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"the previous release ({PREVIOUS_RELEASE}) is not in this checkout's git history")
    with tarfile.open(fileobj=BytesIO(found.stdout)) as archive:
        archive.extractall(destination, filter="data")
    return destination


def _run(source: Path, run_root: Path, world: dict[str, Path], iterations: int, tmp_path: Path):
    command = [sys.executable, "-m", "flows", "run", "--config", str(source / "configs" / "tiny.yaml")]
    settings = [f"run_root={run_root}", f"iterations={iterations}"]
    settings += [
        f"{setting}={world[key]}"
        for setting, key in (
            ("model.policy", "policy"),
            ("data.prompts", "prompts"),
            ("data.eval_prompts", "eval_prompts"),
        )
    ]
    command += [part for setting in settings for part in ("--set", setting)]
    env = {**os.environ, "PYTHONPATH": str(source), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)  # each command starts its own temporary server, as on a laptop
    return subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, timeout=1200)


def test_a_campaign_recorded_by_the_previous_release_opens_and_continues(checkpoint_world, tmp_path):
    from mlflow import MlflowClient

    previous = _previous_release(tmp_path / "previous")
    run_root = tmp_path / "runs"
    first = _run(previous, run_root, checkpoint_world, 1, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    assert client.search_logged_models([experiment.experiment_id]) == []  # what the previous release recorded
    (before,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.kind` = 'iteration'")

    second = _run(ROOT, run_root, checkpoint_world, 2, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    iterations = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.kind` = 'iteration'")
    kept = next(run for run in iterations if run.info.run_id == before.info.run_id)
    assert kept.info.status == "FINISHED" and "rlhf.superseded_by" not in kept.data.tags  # history, as it was
    assert kept.data.metrics == before.data.metrics
    assert sorted(run.data.tags["rlhf.iteration"] for run in iterations) == ["0", "1"]
    assert "MLflow models: " in second.stdout

    models = client.search_logged_models([experiment.experiment_id])
    assert sorted(model.name for model in models) == [  # iteration 1's only
        "actor-iteration-1",
        "critic-iteration-1",
        "reward_model-iteration-1",
    ]
    actor = next(model for model in models if model.tags["rlhf.model"] == "actor")
    assert actor.tags["rlhf.iteration"] == "1" and "rlhf.parent_model" not in actor.tags  # its parent has none
    assert json.loads(actor.tags["mlflow.modelVersions"]) == [{"name": "tiny-actor", "version": "2"}]
    assert [metric.dataset_name for metric in actor.metrics if metric.key == "evaluate/gold_win_rate"] == [
        "eval_prompts[:8]"
    ]
    # Version 1 (the previous release's) has no logged model to rank: `best` can only be version 2.
    assert client.get_model_version_by_alias("tiny-actor", "best").version in (2, "2")

    compare = subprocess.run(
        [sys.executable, "-m", "flows", "compare", "tiny:0", "tiny:1", "--set", f"run_root={run_root}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert compare.returncode == 0, compare.stderr[-3000:]
    policy_row = next(line for line in compare.stdout.splitlines() if "policy (logged model)" in line)
    assert policy_row.split()[-2:] == ["-", actor.model_id]  # iteration 0 from before, iteration 1 with its model
