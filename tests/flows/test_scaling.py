"""Scaling out on existing engines (issue 11): the generation stages' shards on a real local Dask cluster of 2
workers give byte-identical outputs to running them in the stage's own process, so the runner is part of no
input key and a campaign started locally continues on a cluster reusing what exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.config import load_config
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
    rollout = json.loads(next((tmp_path / "tiny" / "rollout").glob("*/_manifest.json")).read_text())
    assert rollout["runtime"]["shards"] == 2
    assert not list((tmp_path / "tiny").glob("*/*.partial")), "the shard pieces are removed with the output in place"
