"""Sharded training stages (issue 25): `execution.accelerate_config` with FSDP2 over 2 gloo processes trains what one
process trains (as 2 unsharded processes do, issue 11), writes the same plain `save_pretrained` folders, saves its
optimizer states as a distributed checkpoint (each process its part, issue 32) and resumes after kill -9 as if it never
crashed; the settings it cannot run are refused in one line."""

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

from campaign.config import load_config
from flows.rlhf_pipeline import rlhf_campaign
from runtime.checkpointer import OPTIMIZERS, TRAINING_STATE_FILE
from storage.checkpoints import CHECKPOINT_METADATA, load_state
from tests.flows.test_bad_inputs import Case, _assert_refused, _main, _run
from tests.flows.test_scaling import CONFIGS, stage_files, tiny_config

FSDP = CONFIGS / "accelerate" / "fsdp.yaml"
SHARDED = ("execution.training_processes=2", f"execution.accelerate_config={FSDP}")
VERIFIABLE = ("reward.source=function", "reward.function=demo.gold:gold_score", "ppo.epochs=2")


def _manifest(run_root: Path, stage: str) -> Path:
    (manifest,) = (run_root / "tiny" / stage).glob("*/_manifest.json")
    return manifest


@pytest.fixture(scope="module")
def one_process(prefect_server, checkpoint_world, tmp_path_factory) -> Path:
    """The ppo_update output of a verifiable-reward campaign trained in the stage's own process (no reward model,
    whose dropout would differ per process; the reward model's sharded training is pinned in
    tests/rlhf_core/test_distributed.py)."""
    config = tiny_config(checkpoint_world, tmp_path_factory.mktemp("one"), *VERIFIABLE)
    assert rlhf_campaign(config, return_state=True).is_completed()
    return _manifest(config.run_root, "ppo_update").parent


def _assert_same_policy(one: Path, two: Path) -> None:
    assert one.name == two.name, "how training launched is part of no input key"
    weights_one = load_file(one / "actor" / "model.safetensors")
    weights_two = load_file(two / "actor" / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_sharded_update_trains_the_policy_of_one_process(one_process, checkpoint_world, tmp_path):
    """The update sharded over 2 processes has the in-process update's input key, its weights to float rounding,
    each process's part of the optimizer states and each process's peak memory."""
    config = tiny_config(checkpoint_world, tmp_path, *VERIFIABLE, *SHARDED)
    assert rlhf_campaign(config, return_state=True).is_completed()
    update = _manifest(config.run_root, "ppo_update")
    _assert_same_policy(one_process, update.parent)
    optimizer = sorted(path.name for path in (update.parent / OPTIMIZERS).iterdir())
    assert optimizer == [CHECKPOINT_METADATA, "__0_0.distcp", "__1_0.distcp"]
    metrics = json.loads(update.read_text())["metrics"]
    assert metrics["peak_memory_mb"] == max(metrics["peak_memory_mb_rank0"], metrics["peak_memory_mb_rank1"]) > 0


@pytest.mark.slow
def test_two_training_processes_train_the_policy_of_one(one_process, checkpoint_world, tmp_path):
    """Issue 11: the update in 2 `accelerate launch` processes (gloo, unsharded) has the input key of the in-process
    one and its weights to float rounding (here, beside the sharded cases, to share their one-process campaign)."""
    config = tiny_config(checkpoint_world, tmp_path, *VERIFIABLE, "execution.training_processes=2")
    assert rlhf_campaign(config, return_state=True).is_completed()
    _assert_same_policy(one_process, _manifest(config.run_root, "ppo_update").parent)


@pytest.fixture(scope="module")
def ray_nodes():
    """A real Ray cluster of 2 nodes on this machine (127.0.0.1), one CPU each, for the module: one training worker
    fits a node, so 2 workers on 2 nodes are on different machines as far as Ray knows, and a third has no node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


@pytest.mark.slow
def test_sharded_training_on_two_ray_nodes_trains_the_policy_of_one_process(
    one_process, checkpoint_world, tmp_path, ray_nodes
):
    """Ray Train places the 2 sharded workers on the 2 nodes of a Ray cluster (`execution.training_launcher` ray at
    `execution.address`); they train what one process trains."""
    on_ray = ("execution.training_launcher=ray", f"execution.address={ray_nodes}")
    config = tiny_config(checkpoint_world, tmp_path, *VERIFIABLE, *SHARDED, *on_ray)
    assert rlhf_campaign(config, return_state=True).is_completed()
    _assert_same_policy(one_process, _manifest(config.run_root, "ppo_update").parent)


@pytest.mark.slow
def test_a_node_that_never_joins_is_a_timeout_in_one_line(prefect_server, checkpoint_world, tmp_path, capfd, ray_nodes):
    """3 sharded training workers on the module's Ray cluster, with room for 2 (the third node never joins; the same
    cluster as the test above, rather than one more cluster started for this one): `rlhf run` waits
    `execution.rendezvous_timeout`, then exits 2 with one line naming the settings, and writes no update."""
    argv = _run(
        tmp_path, checkpoint_world, *VERIFIABLE, f"execution.accelerate_config={FSDP}",
        "execution.training_processes=3", "execution.training_launcher=ray", f"execution.address={ray_nodes}",
        "execution.rendezvous_timeout=5",
    )  # fmt: skip
    code, stderr = _main(argv, capfd)
    lines = stderr.strip().splitlines()
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[-1].startswith("rlhf: `execution.training_processes` 3 Ray Train workers"), stderr[-3000:]
    assert "`execution.rendezvous_timeout` 5 s" in lines[-1]
    assert not list((tmp_path / "runs").glob("*/ppo_update/*")), "no update output, partial or whole"


@pytest.mark.slow
def test_a_sharded_campaign_resumes_after_kill_minus_nine_as_if_never_crashed(
    prefect_server, checkpoint_world, tmp_path
):
    """`rlhf run` with both training stages sharded over 2 processes, killed while the sharded PPO workers have saved
    an epoch of the first iteration's update (every process its part of the checkpoint), then run again: every output
    of both iterations (the second continues the first's optimizer states) is the one of a sharded campaign that never
    crashed, byte for byte."""
    from prefect.settings import PREFECT_API_URL

    overrides = [
        f"model.policy={checkpoint_world['policy']}",
        f"data.prompts={checkpoint_world['prompts']}",
        f"data.eval_prompts={checkpoint_world['eval_prompts']}",
        *SHARDED, "ppo.epochs=4", "reward_model.epochs=2", "execution.checkpoint_seconds=0",
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
    assert {path.name for path in checkpoint.iterdir()} == {
        CHECKPOINT_METADATA, "__0_0.distcp", "__1_0.distcp", TRAINING_STATE_FILE
    }  # fmt: skip
    assert rlhf_campaign(crashed, return_state=True).is_completed()
    assert stage_files(crashed.run_root) == stage_files(uninterrupted.run_root)
    assert len(list(stage_dir.glob("[!.]*/_manifest.json"))) == 2


@pytest.mark.slow
def test_a_sharded_update_killed_mid_stage_resumes_in_one_process_issue_32(
    one_process, prefect_server, checkpoint_world, tmp_path, monkeypatch
):
    """`rlhf run` with the update sharded over 2 processes, killed once they have saved an epoch's checkpoint (each its
    part), then run again in this one process: the update continues from that checkpoint and ends with the policy of
    the in-process update that never crashed, to float rounding."""
    from prefect.settings import PREFECT_API_URL

    overrides = [
        f"run_root={tmp_path}", f"model.policy={checkpoint_world['policy']}", f"data.prompts={checkpoint_world['prompts']}",
        f"data.eval_prompts={checkpoint_world['eval_prompts']}", "iterations=1", "sizes.rows_per_shard=8", *VERIFIABLE,
        "execution.checkpoint_seconds=0",
    ]  # fmt: skip
    stage_dir = tmp_path / "tiny" / "ppo_update"
    command = [sys.executable, "-m", "flows", "run", "--config", str(CONFIGS / "tiny.yaml")]
    command += [f"--set={o}" for o in (*overrides, *SHARDED)]
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
    (checkpoint,) = stage_dir.glob("*.partial/epoch-*")
    assert {"__0_0.distcp", "__1_0.distcp"} <= {path.name for path in checkpoint.iterdir()}
    loaded = []
    monkeypatch.setattr(
        "runtime.checkpointer.load_state", lambda folder, state: loaded.append(folder) or load_state(folder, state)
    )
    assert rlhf_campaign(load_config(CONFIGS / "tiny.yaml", overrides), return_state=True).is_completed()
    assert [folder.name for folder in loaded] == [checkpoint.name], "the update continued from the 2 processes' epoch"
    resumed = _manifest(tmp_path, "ppo_update").parent
    assert "peak_memory_mb_rank1" not in json.loads((resumed / "_manifest.json").read_text())["metrics"]
    _assert_same_policy(one_process, resumed)


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
