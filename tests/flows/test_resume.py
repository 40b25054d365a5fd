"""Resume after kill -9: a campaign killed in the middle of a training stage, then run again, ends
with exactly the outputs (checkpoints, shards, samples) of a campaign that never crashed.

One such campaign, killed twice: once in iteration 1's reward-model training, then, resumed, in iteration 1's update
(slow: CI's crash step runs it beside tests/flows/test_crash.py, which kills iteration 0 at every stage in every
window). The
campaign that never crashed is also the starting point of the test of inputs edited in place, which edits its own
copy of the inputs."""

from __future__ import annotations

import json
import os
import shutil
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


COMMON = ["reward_model.epochs=2", "ppo.epochs=2", "execution.checkpoint_seconds=0"]
"""Two epochs and a checkpoint after each but the last: a kill after the first epoch's checkpoint leaves one epoch
for the resumed stage to train from it (weights, optimizer states and random state)."""
KILLS = {"train_reward_model": "train_reward_model:computing#3", "ppo_update": "ppo_update:computing#1"}
"""Where each command is held and killed (storage/holds.py): iteration 1's first mid-stage checkpoint of the stage.
The first command reaches ``train_reward_model:computing`` at iteration 0's checkpoint (#1), at the end of iteration
0's training (#2), then at iteration 1's checkpoint (#3); the second resumes iteration 1, so its first update is
iteration 1's."""


def _world(world: dict[str, Path]) -> list[str]:
    return [f"model.policy={world['policy']}", *(f"data.{k}={world[k]}" for k in ("prompts", "eval_prompts"))]


@pytest.fixture(scope="module")
def uninterrupted(prefect_server, checkpoint_world, tmp_path_factory):
    """A two-iteration campaign that never crashed, on a copy of the inputs (the test of inputs edited in place edits
    them): its config, and the hashes of its outputs as it finished."""
    root = tmp_path_factory.mktemp("uninterrupted")
    world = {name: root / "world" / path.name for name, path in checkpoint_world.items()}
    shutil.copytree(checkpoint_world["policy"], world["policy"])
    for name in ("prompts", "eval_prompts"):
        shutil.copy(checkpoint_world[name], world[name])
    config = load_config(TINY, [f"run_root={root / 'runs'}", *_world(world), *COMMON])
    rlhf_campaign(config)
    return config.run_root, world, _file_hashes(config.run_root / config.campaign)


def _kill_when_held(command: list[str], point: str, tmp_path: Path) -> None:
    """Run ``command`` (with the session's Prefect server) until it holds at ``point``, then kill -9 it."""
    from prefect.settings import PREFECT_API_URL

    held = tmp_path / f"held-{point.partition(':')[0]}"
    environment = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "RLHF_HOLD_AT": point,
        "RLHF_HOLD_FILE": str(held),
    }
    with open(tmp_path / "run.log", "ab") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=log)
        deadline = time.monotonic() + 300
        try:
            while not held.exists():
                assert process.poll() is None, f"the campaign ended before {point}; see {tmp_path / 'run.log'}"
                assert time.monotonic() < deadline, f"timed out waiting for {point}"
                time.sleep(0.1)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL


@pytest.mark.slow  # the crash step of .ci/run
def test_kill_minus_nine_mid_training_twice_then_rerun_equals_a_run_that_never_crashed(
    uninterrupted, checkpoint_world, tmp_path
):
    """Killed once iteration 0's output of ``train_reward_model`` is finished and iteration 1's has saved an epoch;
    run again, and killed the same way in ``ppo_update``; run again to the end."""
    _, _, hashes = uninterrupted
    crashed = load_config(TINY, [f"run_root={tmp_path / 'runs'}", *_world(checkpoint_world), *COMMON])
    campaign = crashed.run_root / crashed.campaign
    overrides = [f"run_root={crashed.run_root}", *_world(checkpoint_world), *COMMON]
    command = [sys.executable, "-m", "flows", "run", "--config", str(TINY), *(f"--set={o}" for o in overrides)]
    for stage, point in KILLS.items():
        _kill_when_held(command, point, tmp_path)
        assert list((campaign / stage).glob("*.partial/epoch-*")), f"the kill must land in the middle of {stage}"
        assert len(list((campaign / stage).glob("*/_manifest.json"))) == 1, f"iteration 0's {stage} is finished"

    rlhf_campaign(crashed)

    assert any(path.startswith("ppo_update/") and path.endswith("actor/model.safetensors") for path in hashes)
    assert _file_hashes(campaign) == hashes
    for stage in KILLS:
        assert not list((campaign / stage).glob("*.partial")), "mid-stage checkpoints are removed once it is finished"


def test_issue14_inputs_edited_in_place_are_recomputed_when_asked_and_never_reused_stale(uninterrupted):
    """A prompt file edited in place, then a retrained checkpoint of the same size at the same path: each is
    a base input, part of every stage's key. A finished iteration is history (running the campaign again keeps
    it, tests/flows/test_history.py); recomputing it from iteration 0 re-runs every stage, and nothing made
    from the old content is reused."""
    import torch
    from transformers import AutoModelForCausalLM

    run_root, world, _ = uninterrupted
    config = load_config(TINY, [f"run_root={run_root}", *_world(world), *COMMON, "iterations=1"])  # iteration 0 alone
    campaign = config.run_root / config.campaign

    def outputs(stage: str) -> int:
        return len(list((campaign / stage).glob("*/_manifest.json")))

    assert (outputs("initialize"), outputs("evaluate")) == (1, 2), "the finished two-iteration campaign"
    text = world["prompts"].read_text()
    world["prompts"].write_text(text.replace("the", "eht", 1))  # same size, same inode
    rlhf_campaign(config)
    assert (outputs("initialize"), outputs("evaluate")) == (1, 2), "a finished iteration is kept"
    rlhf_campaign(config, from_iteration=0)
    assert (outputs("initialize"), outputs("evaluate")) == (2, 3)

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
    assert (outputs("initialize"), outputs("evaluate")) == (3, 4)
