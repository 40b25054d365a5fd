"""Resume after kill -9: a campaign killed in the middle of a training stage, then run again, ends
with exactly the outputs (checkpoints, shards, samples) of a campaign that never crashed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from campaign.config import load_config
from flows.rlhf_pipeline import rlhf_campaign

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def _file_hashes(campaign_dir: Path) -> dict[str, str]:
    """``stage/key/file -> sha256`` of every finished stage output (from the verified manifests)."""
    hashes = {}
    for manifest_path in campaign_dir.glob("*/*/_manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        for entry in manifest["files"]:
            hashes[f"{manifest_path.parent.relative_to(campaign_dir)}/{entry['path']}"] = entry["sha256"]
    return hashes


COMMON = ["sizes.rollout_prompts=32", "ppo.epochs=8", "reward_model.epochs=6", "execution.checkpoint_seconds=0"]


def _world(checkpoint_world) -> list[str]:
    return [
        f"model.policy={checkpoint_world['policy']}",
        *(f"data.{k}={checkpoint_world[k]}" for k in ("prompts", "eval_prompts")),
    ]


@pytest.fixture(scope="module")
def uninterrupted(prefect_server, checkpoint_world, tmp_path_factory):
    config = load_config(
        TINY, [f"run_root={tmp_path_factory.mktemp('uninterrupted')}", *_world(checkpoint_world), *COMMON]
    )
    rlhf_campaign(config)
    return _file_hashes(config.run_root / config.campaign)


@pytest.mark.parametrize("stage", ["train_reward_model", "ppo_update"])
def test_kill_minus_nine_mid_training_then_rerun_equals_a_run_that_never_crashed(
    stage, uninterrupted, checkpoint_world, tmp_path
):
    """Killed once iteration 0's output of ``stage`` is finished and iteration 1's has saved an epoch."""
    from prefect.settings import PREFECT_API_URL

    crashed = load_config(TINY, [f"run_root={tmp_path}", *_world(checkpoint_world), *COMMON])
    stage_dir = crashed.run_root / crashed.campaign / stage
    overrides = [f"run_root={crashed.run_root}", *_world(checkpoint_world), *COMMON]
    command = [sys.executable, "-m", "flows", "run", "--config", str(TINY), *(f"--set={o}" for o in overrides)]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while not (len(list(stage_dir.glob("*/_manifest.json"))) == 1 and list(stage_dir.glob("*.partial/epoch-*"))):
            assert process.poll() is None, "the campaign ended before it could be killed mid-stage"
            assert time.monotonic() < deadline, f"timed out waiting for {stage} of iteration 1"
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert list(stage_dir.glob("*.partial/epoch-*")), "the kill must land in the middle of the stage"
    assert len(list(stage_dir.glob("*/_manifest.json"))) == 1

    rlhf_campaign(crashed)

    resumed = _file_hashes(crashed.run_root / crashed.campaign)
    assert any(path.startswith("ppo_update/") and path.endswith("actor/model.safetensors") for path in uninterrupted)
    assert resumed == uninterrupted
    assert not list(stage_dir.glob("*.partial")), "mid-stage checkpoints are removed once the output is finished"


def test_issue14_inputs_edited_in_place_are_recomputed_when_asked_and_never_reused_stale(
    prefect_server, checkpoint_world, tmp_path
):
    """A prompt file edited in place, then a retrained checkpoint of the same size at the same path: each is
    a base input, part of every stage's key. A finished iteration is history (running the campaign again keeps
    it, tests/flows/test_history.py); recomputing it from iteration 0 re-runs every stage, and nothing made
    from the old content is reused."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    world = {name: tmp_path / "world" / path.name for name, path in checkpoint_world.items()}
    shutil.copytree(checkpoint_world["policy"], world["policy"])
    for name in ("prompts", "eval_prompts"):
        shutil.copy(checkpoint_world[name], world[name])
    config = load_config(TINY, [f"run_root={tmp_path / 'runs'}", *_world(world), "iterations=1"])
    campaign = config.run_root / config.campaign

    def outputs(stage: str) -> int:
        return len(list((campaign / stage).glob("*/_manifest.json")))

    rlhf_campaign(config)
    text = world["prompts"].read_text()
    world["prompts"].write_text(text.replace("the", "eht", 1))  # same size, same inode
    rlhf_campaign(config)
    assert (outputs("initialize"), outputs("evaluate")) == (1, 1), "a finished iteration is kept"
    rlhf_campaign(config, from_iteration=0)
    assert (outputs("initialize"), outputs("evaluate")) == (2, 2)

    weights = world["policy"] / "model.safetensors"
    size = weights.stat().st_size
    torch.manual_seed(1)
    retrained = AutoModelForCausalLM.from_pretrained(world["policy"])
    with torch.no_grad():
        for parameter in retrained.parameters():
            parameter.add_(0.01)
    retrained.save_pretrained(world["policy"])
    assert weights.stat().st_size == size
    rlhf_campaign(config, from_iteration=0)
    assert (outputs("initialize"), outputs("evaluate")) == (3, 3)
