"""The tiny campaign under bf16 on the CPU, end to end: every stage that runs a model loads it through the
seam, on the configured device, in the dtype its role gets, and records where it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from campaign.config import load_config
from flows.rlhf_pipeline import rlhf_campaign

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
MODELS = {
    "initialize": [("actor", "float32", True), ("critic", "float32", True)],
    "sample_candidates": [("actor", "float32", False)],
    "collect_preferences": [],  # the gold labeler runs no model
    "train_reward_model": [("reward_model", "float32", True)],
    "rollout": [
        ("actor", "float32", False),  # the actor computes as in training: fp32 weights under bf16 autocast
        ("critic", "bfloat16", False),
        ("reward_model", "bfloat16", False),
        ("reference", "bfloat16", False),
    ],
    "compute_advantages": [],
    "ppo_update": [("actor", "float32", True), ("critic", "float32", True)],
    "evaluate": [("actor", "float32", False), ("reference", "bfloat16", False), ("reward_model", "bfloat16", False)],
}


@pytest.fixture(scope="module")
def bf16_campaign(prefect_server, checkpoint_world, tmp_path_factory):
    config = load_config(
        TINY,
        [
            f"run_root={tmp_path_factory.mktemp('bf16')}",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
            "precision=bf16",
            "execution.device=cpu",
        ],
    )
    state = rlhf_campaign(config, return_state=True)
    return config, state


def _manifests(config, stage: str) -> list[dict]:
    folder = config.run_root / config.campaign / stage
    return [json.loads((output / "_manifest.json").read_text()) for output in sorted(folder.iterdir())]


def test_the_bf16_campaign_finishes_with_finite_metrics(bf16_campaign):
    config, state = bf16_campaign
    assert state.is_completed(), state
    (evaluation,) = _manifests(config, "evaluate")[-1:]
    assert 0.0 <= evaluation["metrics"]["gold_win_rate"] <= 1.0
    for stage in MODELS:
        for manifest in _manifests(config, stage):
            assert all(value == value for value in manifest["metrics"].values()), (stage, manifest["metrics"])


@pytest.mark.parametrize("stage", sorted(MODELS))
def test_every_stage_ran_its_models_on_the_seams_device_in_its_roles_dtype(bf16_campaign, stage):
    config, _ = bf16_campaign
    manifests = _manifests(config, stage)
    assert manifests and len(manifests) == (1 if stage == "initialize" else config.iterations)
    for manifest in manifests:
        runtime = manifest["runtime"]
        assert runtime["device"] == "cpu" and config.execution.torch_threads == "auto"
        assert runtime["torch_threads"] == 1  # auto: one thread for a model under 20 M parameters
        loaded = [(m["role"], m["dtype"], m["trainable"]) for m in runtime.get("models", [])]
        assert loaded == MODELS[stage]
        assert all(m["device"] == "cpu" for m in runtime.get("models", []))
        if MODELS[stage]:  # initialize only copies weights, which are fp32 whatever the precision
            assert runtime["precision"] == ("fp32" if stage == "initialize" else "bf16")
        assert manifest["metrics"]["peak_memory_mb"] >= 0 and manifest["metrics"]["seconds"] > 0


@pytest.fixture(scope="module")
def lora_campaign(prefect_server, checkpoint_world, tmp_path_factory):
    config = load_config(
        TINY,
        [
            f"run_root={tmp_path_factory.mktemp('lora')}",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
            "precision=bf16",
            "model.lora.r=4",
            "execution.gradient_checkpointing=true",
        ],
    )
    return config, rlhf_campaign(config, return_state=True)


def test_lora_with_bf16_and_checkpointing_trains_and_stores_adapters_only(lora_campaign):
    config, state = lora_campaign
    assert state.is_completed(), state
    campaign = config.run_root / config.campaign
    for stage, folder in (("ppo_update", "actor"), ("ppo_update", "critic"), ("train_reward_model", "reward_model")):
        for output in sorted((campaign / stage).iterdir()):
            names = {path.name for path in (output / folder).iterdir()}
            assert "adapter_model.safetensors" in names and "model.safetensors" not in names, (stage, names)
    for manifest in _manifests(config, "rollout") + _manifests(config, "evaluate"):
        reference = next(m for m in manifest["runtime"]["models"] if m["role"] == "reference")
        assert reference["shares_weights_with"] == "actor"  # the base with adapters off, never a second copy
    final = _manifests(config, "evaluate")[-1]["metrics"]
    assert 0.0 <= final["gold_win_rate"] <= 1.0 and final["kl_to_reference"] == final["kl_to_reference"]


def test_export_merges_the_adapters_into_a_plain_hugging_face_folder(lora_campaign, checkpoint_world, tmp_path):
    from transformers import AutoModelForCausalLM

    from flows.cli import main

    config, _ = lora_campaign
    location = [f"--set=run_root={config.run_root}"]
    assert main(["export", f"{config.campaign}:1", str(tmp_path / "aligned"), *location]) == 0
    assert not list((tmp_path / "aligned").glob("adapter_*")) and (tmp_path / "aligned" / "config.json").is_file()
    aligned = AutoModelForCausalLM.from_pretrained(tmp_path / "aligned").eval()
    base = AutoModelForCausalLM.from_pretrained(checkpoint_world["policy"]).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert not torch.allclose(aligned(input_ids=ids).logits, base(input_ids=ids).logits)
    assert main(["export", f"{config.campaign}:1", str(tmp_path / "aligned"), *location]) == 2  # not empty
    assert main(["export", config.campaign, str(tmp_path / "rm"), "--model", "reward_model", *location]) == 0
    assert (tmp_path / "rm" / "reward_head.safetensors").is_file()
