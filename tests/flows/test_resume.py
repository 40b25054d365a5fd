"""Resume after kill -9: a campaign killed in the middle of a PPO update, then run again, ends
with exactly the outputs (checkpoints, shards, samples) of a campaign that never crashed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.config import load_config
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


def test_kill_minus_nine_mid_ppo_then_rerun_equals_a_run_that_never_crashed(prefect_server, checkpoint_world, tmp_path):
    from prefect.settings import PREFECT_API_URL

    common = [
        f"model.policy={checkpoint_world['policy']}",
        f"data.prompts={checkpoint_world['prompts']}",
        f"data.eval_prompts={checkpoint_world['eval_prompts']}",
        "sizes.rollout_prompts=32",
        "ppo.epochs=8",
    ]
    uninterrupted = load_config(TINY, [f"run_root={tmp_path / 'uninterrupted'}", *common])
    rlhf_campaign(uninterrupted)

    crashed = load_config(TINY, [f"run_root={tmp_path / 'crashed'}", *common])
    ppo_dir = crashed.run_root / crashed.campaign / "ppo_update"
    command = [
        sys.executable,
        "-m",
        "flows",
        "run",
        "--config",
        str(TINY),
        *(f"--set={o}" for o in [f"run_root={crashed.run_root}", *common]),
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    try:
        # Iteration 0's PPO output is finished and iteration 1's update has saved an epoch: kill now.
        while not (len(list(ppo_dir.glob("*/_manifest.json"))) == 1 and list(ppo_dir.glob("*.partial/epoch-*"))):
            assert process.poll() is None, "the campaign ended before it could be killed mid-update"
            assert time.monotonic() < deadline, "timed out waiting for the PPO update of iteration 1"
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert list(ppo_dir.glob("*.partial/epoch-*")), "the kill must land in the middle of the update"
    assert len(list(ppo_dir.glob("*/_manifest.json"))) == 1

    rlhf_campaign(crashed)

    expected = _file_hashes(uninterrupted.run_root / uninterrupted.campaign)
    resumed = _file_hashes(crashed.run_root / crashed.campaign)
    assert any(path.startswith("ppo_update/") and path.endswith("actor/model.safetensors") for path in expected)
    assert resumed == expected
    assert not list(ppo_dir.glob("*.partial")), "mid-stage checkpoints are removed once the output is finished"
