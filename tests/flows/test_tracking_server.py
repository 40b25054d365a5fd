"""A real MLflow tracking server (issue 11): `mlflow server` with a SQLite database and an artifacts folder,
started by the test on 127.0.0.1. The tiny campaign records through it; then, from a fresh, empty run root,
the campaign continues and an iteration is replayed using only what the server holds (stage outputs are
uploaded as artifacts and downloaded when a stage needs them). Also: the campaign's Prefect global
concurrency limit exists, with one slot."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from campaign.config import load_config
from campaign.store import resolve_run
from flows.cli import main
from flows.concurrency import campaign_limit
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_iteration, rlhf_replay
from storage.manifest import read_manifest

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CAMPAIGN = "tracked"
"""The campaign's own name: its Prefect concurrency limit is no other test's (a slot another test's cancelled run
left held on the session's server, which expires no lease, would make it wait)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed when the server stops
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert server.poll() is None, (root / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the MLflow server did not answer within 120 s"
        time.sleep(0.5)
    yield url, root
    os.killpg(server.pid, 15)
    server.wait(timeout=30)
    log.close()


def _config(world, run_root: Path, url: str, *overrides: str):
    return load_config(
        CONFIGS / "tiny.yaml",
        [
            f"run_root={run_root}",
            f"tracking_uri={url}",
            f"model.policy={world['policy']}",
            f"data.prompts={world['prompts']}",
            f"data.eval_prompts={world['eval_prompts']}",
            "iterations=1",
            f"campaign={CAMPAIGN}",
            *overrides,
        ],
    )


def test_a_campaign_continues_and_replays_from_an_empty_run_root_with_only_the_server(
    prefect_server, checkpoint_world, tracking_server, tmp_path, capsys
):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    url, server_root = tracking_server
    first = _config(checkpoint_world, tmp_path / "first", url)
    state = rlhf_campaign(first, return_state=True)
    assert state.is_completed(), state
    assert not (first.run_root / "mlflow.db").exists(), "the server holds the runs, not a local store"
    assert any((server_root / "artifacts").rglob("_manifest.json")), "stage outputs are uploaded to the server"

    # A fresh, empty run root: every upstream output comes from the server.
    second = _config(checkpoint_world, tmp_path / "second", url)
    continued = rlhf_iteration(second)
    assert continued.policy.stage == "ppo_update" and not continued.policy.reused
    for stage in ("train_reward_model", "ppo_update"):  # iteration 0's, fetched from the server, and iteration 1's
        assert len(list((second.run_root / CAMPAIGN / stage).glob("[!.]*/_manifest.json"))) == 2, stage
    (evaluation,) = (second.run_root / CAMPAIGN / "evaluate").glob("[!.]*")  # iteration 1's (none needed iteration 0's)
    source = resolve_run(second, f"{CAMPAIGN}:0")
    replay_run = rlhf_replay(replay_config(second, source, ["advantages.kl_coef=0.2"]), source)

    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name(CAMPAIGN)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    iterations = sorted(
        run.data.tags.get("rlhf.iteration") for run in runs if run.data.tags.get("rlhf.kind") == "iteration"
    )
    assert iterations == ["0", "1"]
    assert client.get_run(replay_run).data.tags["rlhf.replay_of"] == source
    assert all(run.info.status == "FINISHED" for run in runs)
    version = client.get_model_version_by_alias(f"{CAMPAIGN}-actor", "latest")
    assert int(version.version) == 2
    assert not version.source.startswith("file://"), "a model version on a server points at its artifacts"

    with get_client(sync_client=True) as prefect:
        limit = prefect.read_global_concurrency_limit_by_name(campaign_limit(CAMPAIGN))
    assert limit.limit == 1 and limit.active_slots == 0

    # Issue 32: running the finished campaign again restores a deleted output of its newest iteration from the
    # server's copy. Iteration 0's outputs that iteration 1 did not need were never fetched here: they stay away, as
    # outputs `rlhf gc` removed would.
    shutil.rmtree(evaluation)
    rollouts = sorted((second.run_root / CAMPAIGN / "rollout").glob("[!.]*"))
    overrides = [f"run_root={second.run_root}", f"tracking_uri={url}", "iterations=2", f"campaign={CAMPAIGN}"]
    world = [f"model.policy={checkpoint_world['policy']}"]
    world += [f"data.{name}={checkpoint_world[name]}" for name in ("prompts", "eval_prompts")]
    assert main(["run", "--config", str(CONFIGS / "tiny.yaml"), *(f"--set={o}" for o in world + overrides)]) == 0
    said = capsys.readouterr().out
    assert f"restored {evaluation} (the evaluate output of iteration 1) from what MLflow run" in said
    assert "all 2 iterations are finished; nothing to run" in said
    assert read_manifest(evaluation).stage == "evaluate"
    assert sorted((second.run_root / CAMPAIGN / "rollout").glob("[!.]*")) == rollouts
