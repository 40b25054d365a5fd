"""Issue 45, supervised fine-tuning before iteration 0, end to end: a tiny DPO campaign with ``sft.data`` on the test's
random GPT-2 (SFT, then one iteration), whose initial policy and reference are the SFT output (the reference's stored
log-probs of the iteration's pairs are the SFT model's), and a second command that continues the campaign with the SFT
stage reused; the stage alone, packed and not."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM

from campaign.gc import plan_gc
from campaign.store import campaign_layout, resolve_run, stage_run
from flows.export import export_model
from flows.iterations import context_for, resolve_base, supervised_base, tracking_store
from flows.lineage import ancestry, campaign_manifests
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_replay
from rlhf_core.dpo import reference_logprobs
from storage.manifest import read_manifest
from storage.schemas import SFT_EXAMPLES
from storage.shards import read_table
from storage.tracking import TAG_INPUT_KEY, TAG_OUTPUT_PREFIX, TAG_STAGE
from tasks.dpo_update import stored_pairs
from tasks.sft import sft as sft_stage
from tasks.text import load_tokenizer
from tests.flows.campaigns import tiny_config


def _demonstrations(world, folder):
    """Every training prompt of ``world`` completed by " happy ." (words of the world's vocabulary): 48 rows."""
    prompts = [json.loads(line)["prompt"] for line in world["prompts"].read_text().splitlines()]
    data = folder / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": " happy ."}) + "\n" for p in prompts))
    return data


@pytest.fixture(scope="module")
def campaign(prefect_server, checkpoint_world, tmp_path_factory):
    """One DPO iteration of configs/tiny.yaml after SFT on :func:`_demonstrations`, at a learning rate that moves the
    tiny model."""
    root = tmp_path_factory.mktemp("sft")
    data = _demonstrations(checkpoint_world, root)
    overrides = (
        "campaign=sft-e2e", "update=dpo", "iterations=1", f"sft.data={data}", "sft.epochs=1", "sft.batch_size=16",
        "sft.learning_rate=1e-2",
    )  # fmt: skip
    config = tiny_config(root / "runs", checkpoint_world, *overrides)
    rlhf_campaign(config)
    return config


def _output(config, parent: str, stage: str):
    """The output folder of ``stage`` that the run ``parent`` used (its own or a reused one)."""
    tracker = tracking_store(config).tracker()
    run_id = stage_run(tracker, tracker.experiment_id(config.campaign), parent, stage)
    return campaign_layout(config).stage_dir(stage, tracker.run(run_id).tags[TAG_INPUT_KEY])


def _sft_outputs(config) -> list:
    return sorted((config.run_root / config.campaign / "sft").iterdir())


def test_sft_trains_the_initial_policy_and_reference_of_iteration_0(campaign, checkpoint_world):
    [sft] = _sft_outputs(campaign)
    manifest = read_manifest(sft)
    examples = read_table(sft, "sft_examples")
    assert examples.schema.equals(SFT_EXAMPLES) and examples.num_rows == 48
    assert manifest.metrics["optimizer_steps"] == 3  # 48 examples, 16 a step, one epoch
    pretrained = AutoModelForCausalLM.from_pretrained(checkpoint_world["policy"]).eval()
    tuned = AutoModelForCausalLM.from_pretrained(sft / "actor").eval()  # a whole model: loads without a base
    assert any(not torch.equal(a, b) for a, b in zip(pretrained.parameters(), tuned.parameters(), strict=True))

    parent = resolve_run(campaign, f"{campaign.campaign}:0")
    start = read_manifest(_output(campaign, parent, "initialize"))
    assert start.upstream == {"sft": manifest.digest}  # the lineage's edge: every policy descends from it
    assert start.runtime["inputs"]["sft"] == manifest.digest
    update = read_manifest(_output(campaign, parent, "dpo_update"))
    assert update.upstream["policy"] == start.digest
    # The reference is the SFT model: its stored log-probs of the iteration's pairs are the SFT model's, not the
    # pretrained one's.
    folder = _output(campaign, parent, "reference_logprobs")
    pairs = stored_pairs(
        read_table(folder, "reference_logprobs"), pad_token_id=load_tokenizer(str(sft / "actor")).pad_token_id
    )
    chosen, _ = reference_logprobs(tuned, pairs, batch_size=16)
    torch.testing.assert_close(chosen.total, pairs.ref_chosen.total, rtol=1e-4, atol=1e-4)
    pretrained_chosen, _ = reference_logprobs(pretrained, pairs, batch_size=16)
    assert not torch.allclose(pretrained_chosen.total, pairs.ref_chosen.total, atol=1e-2)


def test_the_lineage_shows_the_sft_output_under_the_policy_and_a_replay_and_export_read_its_base(campaign, tmp_path):
    [sft] = _sft_outputs(campaign)
    digest = read_manifest(sft).digest
    parent = resolve_run(campaign, f"{campaign.campaign}:0")
    evaluation = read_manifest(_output(campaign, parent, "evaluate"))
    manifests = campaign_manifests(campaign_layout(campaign).outputs())
    lineage = [manifest.stage for manifest in ancestry(manifests, [evaluation.digest])]
    assert lineage.index("sft") < lineage.index("initialize") < lineage.index("dpo_update")
    # A replay of iteration 0's update starts from its initial policy, whose weights are the SFT model's.
    replay_run = rlhf_replay(replay_config(campaign, parent, ["dpo.beta=0.5"]), parent)
    assert read_manifest(_output(campaign, replay_run, "dpo_update")).runtime["inputs"]["sft"] == digest
    exported = export_model(campaign, f"{campaign.campaign}:0", tmp_path / "exported")
    assert (exported / "config.json").is_file()


def test_the_sft_stage_is_recorded_once_and_reused_when_the_campaign_continues(campaign):
    before = [read_manifest(folder).digest for folder in _sft_outputs(campaign)]
    rlhf_campaign(campaign.model_copy(update={"iterations": 2}))
    assert [read_manifest(folder).digest for folder in _sft_outputs(campaign)] == before
    tracker = tracking_store(campaign).tracker()
    runs = MlflowClient(tracker.tracking_uri).search_runs(
        [tracker.experiment_id(campaign.campaign)], f"tags.`{TAG_STAGE}` = 'sft'"
    )
    assert len(runs) == 1 and runs[0].data.metrics["sft/train_loss"] > 0
    # Iteration 0's run shows the SFT output it started from (its metrics, its run), as the stages it ran.
    client = MlflowClient(tracker.tracking_uri)
    first, second = (client.get_run(resolve_run(campaign, f"{campaign.campaign}:{i}")) for i in (0, 1))
    assert first.data.metrics["sft/train_loss"] == runs[0].data.metrics["sft/train_loss"]
    assert first.data.tags[f"{TAG_OUTPUT_PREFIX}sft"] == runs[0].info.run_id
    assert "sft/train_loss" not in second.data.metrics and f"{TAG_OUTPUT_PREFIX}sft" not in second.data.tags
    # A campaign is history: once an iteration finished, another SFT key (other code would give one; here another
    # setting) computes no other SFT, and the campaign goes on from the one it started from.
    other = campaign.model_copy(update={"sft": dataclasses.replace(campaign.sft, epochs=2)})
    assert supervised_base(other, resolve_base.fn(other)).policy.sha256 == before[0]
    assert [read_manifest(folder).digest for folder in _sft_outputs(campaign)] == before
    second = resolve_run(campaign, f"{campaign.campaign}:1")
    update = read_manifest(_output(campaign, second, "dpo_update"))
    assert update.runtime["inputs"]["sft"] == before[0]
    # rlhf gc keeping only iteration 1 keeps the SFT output, the base its policies and reference are read from.
    plan = plan_gc(campaign, keep_last=1)
    removed = {folder for folder, _ in plan.remove}
    assert _sft_outputs(campaign)[0] not in removed and any(folder.parent.name == "initialize" for folder in removed)


def test_the_stage_packed_is_another_output_with_the_same_steps_and_less_padding(campaign, checkpoint_world, tmp_path):
    """The ``sft`` stage alone, on the campaign's demonstrations and settings but packed into rows of up to 64 tokens:
    another output (packing is in the stage's key) with the campaign's 3 steps and training loss, to rounding, and
    less padding."""
    [padded] = [read_manifest(folder) for folder in _sft_outputs(campaign)]
    config = campaign.model_copy(
        update={"run_root": tmp_path, "sft": dataclasses.replace(campaign.sft, packing=True, packed_length=64)}
    )
    context = context_for(
        config, 0, resolve_base.fn(config), tracking_store(config).tracker().experiment_id(config.campaign)
    )
    packed = read_manifest(sft_stage.run(context, config).directory)
    assert packed.config["stage"]["sft"]["packing"] is True and packed.digest != padded.digest
    assert packed.metrics["optimizer_steps"] == padded.metrics["optimizer_steps"] == 3
    assert packed.metrics["train_loss"] == pytest.approx(padded.metrics["train_loss"], rel=1e-5)
    assert packed.metrics["padding_share"] < padded.metrics["padding_share"] / 4
