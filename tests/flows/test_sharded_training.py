"""Sharded training stages (issue 25): `execution.accelerate_config` with FSDP2 over 2 gloo processes trains what one
process trains, writes the same plain `save_pretrained` folders, saves its optimizer states sharded (one file per
process) and resumes after kill -9 as if it never crashed; the settings it cannot run are refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flows.config import load_config
from flows.rlhf_pipeline import rlhf_campaign
from tests.flows.test_bad_inputs import Case, _assert_refused, _main, _run
from tests.flows.test_scaling import CONFIGS, stage_files, tiny_config

FSDP = CONFIGS / "accelerate" / "fsdp.yaml"
SHARDED = ("execution.training_processes=2", f"execution.accelerate_config={FSDP}")
VERIFIABLE = ("reward.source=function", "reward.function=demo.gold:gold_score", "ppo.epochs=2")


def _manifest(run_root: Path, stage: str) -> Path:
    (manifest,) = (run_root / "tiny" / stage).glob("*/_manifest.json")
    return manifest


@pytest.mark.slow
def test_a_sharded_update_trains_the_policy_of_one_process(prefect_server, checkpoint_world, tmp_path):
    """A verifiable-reward campaign (no reward model, whose dropout would differ per process; the reward model's
    sharded training is pinned in tests/rlhf_core/test_distributed.py): the update sharded over 2 processes has the
    in-process update's input key and weights to float rounding, and each process's optimizer shard."""
    one = tiny_config(checkpoint_world, tmp_path / "one", *VERIFIABLE)
    two = tiny_config(checkpoint_world, tmp_path / "fsdp", *VERIFIABLE, *SHARDED)
    for config in (one, two):
        assert rlhf_campaign(config, return_state=True).is_completed()
    update_one, update_two = _manifest(one.run_root, "ppo_update"), _manifest(two.run_root, "ppo_update")
    assert update_one.parent.name == update_two.parent.name, "the launch is part of no input key"
    weights_one = load_file(update_one.parent / "actor" / "model.safetensors")
    weights_two = load_file(update_two.parent / "actor" / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-5, msg=name)
    optimizer = sorted(path.name for path in (update_two.parent / "actor_optimizer").iterdir())
    assert optimizer == ["optimizer-00000-of-00002.pt", "optimizer-00001-of-00002.pt", "trainer_state.json"]
    metrics = json.loads(update_two.read_text())["metrics"]
    assert metrics["peak_memory_mb"] == max(metrics["peak_memory_mb_rank0"], metrics["peak_memory_mb_rank1"]) > 0


@pytest.mark.slow
def test_a_sharded_campaign_resumes_after_kill_minus_nine_as_if_never_crashed(
    prefect_server, checkpoint_world, tmp_path
):
    """`rlhf run` with both training stages sharded over 2 processes, killed while the sharded PPO workers have saved
    an epoch of the first iteration's update (every process its optimizer shard), then run again: every output of both
    iterations (the second continues the first's sharded optimizer states) is the one of a sharded campaign that never
    crashed, byte for byte."""
    from prefect.settings import PREFECT_API_URL

    overrides = [
        f"model.policy={checkpoint_world['policy']}",
        f"data.prompts={checkpoint_world['prompts']}",
        f"data.eval_prompts={checkpoint_world['eval_prompts']}",
        *SHARDED, "ppo.epochs=4", "reward_model.epochs=2", "checkpoint_seconds=0",
    ]  # fmt: skip
    uninterrupted = load_config(CONFIGS / "tiny.yaml", [f"run_root={tmp_path / 'uninterrupted'}", *overrides])
    assert rlhf_campaign(uninterrupted, return_state=True).is_completed()

    crashed = load_config(CONFIGS / "tiny.yaml", [f"run_root={tmp_path / 'crashed'}", *overrides])
    stage_dir = crashed.run_root / "tiny" / "ppo_update"
    command = [sys.executable, "-m", "flows", "run", "--config", str(CONFIGS / "tiny.yaml")]
    command += [f"--set={o}" for o in (f"run_root={crashed.run_root}", *overrides)]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    try:
        while not list(stage_dir.glob("*.partial/epoch-*")):
            assert process.poll() is None, "the campaign ended before it could be killed mid-stage"
            assert time.monotonic() < deadline, "timed out waiting for a checkpoint of ppo_update"
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    time.sleep(2)  # the launched workers end with their launcher (it ends with the killed process)
    checkpoint = sorted(stage_dir.glob("*.partial/epoch-*"))[-1]
    assert {path.name for path in (checkpoint / "actor_optimizer").iterdir()} >= {
        "optimizer-00000-of-00002.pt", "optimizer-00001-of-00002.pt"
    }  # fmt: skip
    assert rlhf_campaign(crashed, return_state=True).is_completed()
    assert stage_files(crashed.run_root) == stage_files(uninterrupted.run_root)
    assert len(list(stage_dir.glob("[!.]*/_manifest.json"))) == 2


def _accelerate_config(tmp: Path, text: str) -> str:
    path = tmp / "accelerate.yaml"
    path.write_text(text)
    return f"execution.accelerate_config={path}"


FSDP2 = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
REFUSALS = [
    Case(
        "fsdp-on-one-process",
        lambda t, w: _run(t, w, f"execution.accelerate_config={FSDP}"),
        ("`execution.training_processes` of 2 or more", "FSDP"),
    ),
    Case(
        "fsdp-version-1",
        lambda t, w: _run(t, w, _accelerate_config(t, "distributed_type: FSDP\n"), "execution.training_processes=2"),
        ("`execution.accelerate_config`", "fsdp_version must be 2"),
    ),
    Case(
        "deepspeed",
        lambda t, w: _run(
            t, w, _accelerate_config(t, "distributed_type: DEEPSPEED\n"), "execution.training_processes=2"
        ),
        ("`execution.accelerate_config`", "DEEPSPEED"),
    ),
    Case(
        "fsdp-without-a-layer-class-to-wrap",
        lambda t, w: _run(
            t,
            w,
            _accelerate_config(t, FSDP2 + "  fsdp_transformer_layer_cls_to_wrap: NoSuchLayer\n"),
            "execution.training_processes=2",
        ),  # fmt: skip
        ("`execution.accelerate_config`", "`model.policy`", "NoSuchLayer"),
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda case: case.id)
def test_issue25_settings_sharded_training_cannot_run_are_refused_before_anything_runs(
    case, checkpoint_world, tmp_path, capfd
):
    code, stderr = _main(case.make(tmp_path, checkpoint_world), capfd)
    _assert_refused(code, stderr, tmp_path / "runs", case.names, {})
    assert not (tmp_path / "runs").exists(), "a refused command creates no run root"
