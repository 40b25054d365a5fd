"""Scaling out on existing engines (issue 11): the generation stages' shards on a real local Dask cluster of 2
workers give byte-identical outputs to running them in the stage's own process, so the runner is part of no
input key and a campaign started locally continues on a cluster reusing what exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.config import load_config
from flows.rlhf_pipeline import rlhf_campaign

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FANNED_OUT = ("sample_candidates", "rollout", "evaluate")


def tiny_config(world: dict[str, Path], run_root: Path, *overrides: str):
    # 8 rows per shard: 2 shards of preference prompts (16 x 2 candidates), 2 of rollouts, 1 of evaluation.
    return load_config(
        CONFIGS / "tiny.yaml",
        [
            f"run_root={run_root}",
            f"model.policy={world['policy']}",
            f"data.prompts={world['prompts']}",
            f"data.eval_prompts={world['eval_prompts']}",
            "iterations=1",
            "sizes.rows_per_shard=8",
            *overrides,
        ],
    )


def stage_files(run_root: Path, campaign: str = "tiny") -> dict[str, dict[str, str]]:
    """``stage/input key -> {file: sha256}`` of every finished stage output of the campaign."""
    outputs = {}
    for manifest in sorted((run_root / campaign).glob("*/*/_manifest.json")):
        recorded = json.loads(manifest.read_text())
        key = f"{manifest.parent.parent.name}/{manifest.parent.name}"
        outputs[key] = {entry["path"]: entry["sha256"] for entry in recorded["files"]}
    return outputs


@pytest.fixture(scope="module")
def local_run(prefect_server, checkpoint_world, tmp_path_factory):
    run_root = tmp_path_factory.mktemp("local")
    state = rlhf_campaign(tiny_config(checkpoint_world, run_root), return_state=True)
    assert state.is_completed(), state
    return run_root


@pytest.mark.slow  # a Dask cluster of worker processes: the browser step of .ci/run, with Ray's
def test_dask_outputs_are_byte_identical_to_local(local_run, checkpoint_world, tmp_path):
    config = tiny_config(checkpoint_world, tmp_path, "execution.task_runner=dask", "execution.workers=2")
    state = rlhf_campaign(config, return_state=True)
    assert state.is_completed(), state
    local, dask = stage_files(local_run), stage_files(tmp_path)
    assert {key.split("/")[0] for key in local} >= {*FANNED_OUT, "collect_preferences", "ppo_update"}
    assert all(local.values()), "every output lists its files"
    assert local == dask  # the same input keys (so the same downstream keys), the same bytes
    for stage in FANNED_OUT:
        (manifest,) = (tmp_path / "tiny" / stage).glob("*/_manifest.json")
        runtime = json.loads(manifest.read_text())["runtime"]
        assert runtime["task_runner"] == "dask"
        assert not _kept_in_memory(tmp_path, stage), "a worker's threads share no model"
    rollout = json.loads(next((tmp_path / "tiny" / "rollout").glob("*/_manifest.json")).read_text())
    assert rollout["runtime"]["shards"] == 2
    assert not list((tmp_path / "tiny").glob("*/*.partial")), "the shard pieces are removed with the output in place"


def test_a_campaign_started_locally_continues_on_dask_reusing_what_exists(local_run, checkpoint_world):
    before = stage_files(local_run)
    final = rlhf_campaign(tiny_config(checkpoint_world, local_run, "execution.task_runner=dask"))
    assert final.policy.reused and final.reward_model.reused
    assert stage_files(local_run) == before, "nothing was computed again"


def _kept_in_memory(run_root: Path, stage: str) -> list[str]:
    (manifest,) = (run_root / "tiny" / stage).glob("*/_manifest.json")
    return [
        model["role"] for model in json.loads(manifest.read_text())["runtime"]["models"] if "kept_in_memory" in model
    ]


def test_frozen_models_kept_between_stages_change_no_byte(local_run, checkpoint_world, tmp_path):
    """The local run keeps frozen models in memory for the next stage (the default); loading every model from
    its folder instead gives the same bytes."""
    config = tiny_config(checkpoint_world, tmp_path, "execution.frozen_models_gb=0")
    assert rlhf_campaign(config, return_state=True).is_completed()
    assert stage_files(tmp_path) == stage_files(local_run)
    # At least what this campaign's own stages loaded before (the reference may also come from an earlier test
    # of this session: every campaign of the session starts from the same policy folder).
    assert "actor" in _kept_in_memory(local_run, "rollout")  # sample_candidates loaded it
    assert {"reference", "reward_model"} <= set(_kept_in_memory(local_run, "evaluate"))  # the rollout did
    assert not any(_kept_in_memory(tmp_path, stage) for stage in FANNED_OUT)


@pytest.mark.slow
def test_ray_outputs_are_byte_identical_to_local(local_run, checkpoint_world, tmp_path):
    """A real local Ray instance of 2 CPUs started and stopped by the campaign."""
    config = tiny_config(checkpoint_world, tmp_path, "execution.task_runner=ray", "execution.workers=2")
    assert rlhf_campaign(config, return_state=True).is_completed()
    assert stage_files(tmp_path) == stage_files(local_run)
    (manifest,) = (tmp_path / "tiny" / "rollout").glob("*/_manifest.json")
    assert json.loads(manifest.read_text())["runtime"]["task_runner"] == "ray"


@pytest.mark.slow
def test_two_training_processes_resume_after_kill_minus_nine_as_if_never_crashed(
    prefect_server, checkpoint_world, tmp_path
):
    """`rlhf run` with 2 training processes killed while its launched PPO workers have saved an epoch of iteration
    1, then run again: every output (the reward models and policies the workers trained included) is the one of a
    2-process campaign that never crashed, byte for byte."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    overrides = [
        f"model.policy={checkpoint_world['policy']}",
        f"data.prompts={checkpoint_world['prompts']}",
        f"data.eval_prompts={checkpoint_world['eval_prompts']}",
        "execution.training_processes=2", "ppo.epochs=6", "reward_model.epochs=3", "execution.checkpoint_seconds=0",
    ]  # fmt: skip
    uninterrupted = load_config(CONFIGS / "tiny.yaml", [f"run_root={tmp_path / 'uninterrupted'}", *overrides])
    assert rlhf_campaign(uninterrupted, return_state=True).is_completed()

    crashed = load_config(CONFIGS / "tiny.yaml", [f"run_root={tmp_path / 'crashed'}", *overrides])
    stage_dir = crashed.run_root / "tiny" / "ppo_update"
    command = [sys.executable, "-m", "flows", "run", "--config", str(CONFIGS / "tiny.yaml")]
    command += [f"--set={o}" for o in (f"run_root={crashed.run_root}", *overrides)]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    try:
        while not (
            len(list(stage_dir.glob("[!.]*/_manifest.json"))) == 1 and list(stage_dir.glob("*.partial/epoch-*"))
        ):
            assert process.poll() is None, "the campaign ended before it could be killed mid-stage"
            assert time.monotonic() < deadline, "timed out waiting for ppo_update of iteration 1"
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    time.sleep(2)  # the launched workers end with their launcher (it ends with the killed process)
    assert rlhf_campaign(crashed, return_state=True).is_completed()
    assert stage_files(crashed.run_root) == stage_files(uninterrupted.run_root)
