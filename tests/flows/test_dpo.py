"""Issue 45, iterative ("online") DPO end to end: a tiny campaign with ``update: dpo`` (candidates, gold labels, the
reference's log-probs of the pairs, a DPO update, evaluation; no reward model, rollout or advantages), run in this
process, and a replay of its update with another beta that reads the stored reference log-probs."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM

from campaign.store import campaign_layout, resolve_run, stage_run
from flows.cli import main
from flows.export import export_model
from flows.figures import KL, overoptimisation_figure
from flows.inspection import TOP_PAIRS, inspect_campaign, render_table
from flows.iterations import tracking_store
from flows.replay import replay_config
from flows.report import compare_report
from flows.rlhf_pipeline import rlhf_campaign, rlhf_replay
from storage.manifest import read_manifest
from storage.shards import read_table
from storage.tracking import TAG_INPUT_KEY, TAG_STAGE
from tests.flows.campaigns import tiny_config

DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "loss",
)
"""TRL DPOTrainer's names."""
DPO_OVERRIDES = ("update=dpo", "iterations=2", "dpo.learning_rate=1e-3", "dpo.epochs=4")
PPO_STAGES = {"train_reward_model", "rollout", "compute_advantages", "ppo_update"}


@pytest.fixture(scope="module")
def campaign(prefect_server, checkpoint_world, tmp_path_factory):
    """Two DPO iterations of configs/tiny.yaml on the test's random GPT-2, with a learning rate that moves it."""
    run_root = tmp_path_factory.mktemp("dpo") / "runs"
    config = tiny_config(run_root, checkpoint_world, *DPO_OVERRIDES, "campaign=dpo-e2e")
    rlhf_campaign(config)
    return config


@pytest.fixture(scope="module")
def offline(campaign, checkpoint_world, tmp_path_factory):
    """Offline DPO (labeler import) for two iterations on the decisive pairs the online campaign's iteration 0
    labelled, written as a Hugging Face preference set (prompt/chosen/rejected Parquet)."""
    folder = tmp_path_factory.mktemp("dpo-offline")
    labelled = read_table(_output(campaign, _run(campaign, 0), "collect_preferences"), "preferences")
    decisive = labelled.filter(pa.compute.greater(labelled.column("margin"), 0.0))
    pq.write_table(decisive.select(["prompt", "chosen", "rejected"]), folder / "pairs.parquet")
    imported = ("campaign=dpo-offline", "labeler=import", f"data.preferences={folder / 'pairs.parquet'}")
    config = tiny_config(folder / "runs", checkpoint_world, *DPO_OVERRIDES, *imported)
    rlhf_campaign(config)
    return config, decisive.num_rows


def _run(config, iteration: int) -> str:
    return resolve_run(config, f"{config.campaign}:{iteration}")


def _children(config, parent: str) -> dict[str, str]:
    """``stage -> run id`` of the stage runs recorded under the iteration (or replay) run ``parent``."""
    tracker = tracking_store(config).tracker()
    client = MlflowClient(tracker.tracking_uri)
    runs = client.search_runs(
        [tracker.experiment_id(config.campaign)], f"tags.`mlflow.parentRunId` = '{parent}'", max_results=100
    )
    return {run.data.tags[TAG_STAGE]: run.info.run_id for run in runs}


def _output(config, parent: str, stage: str):
    """The output folder of ``stage`` that the run ``parent`` used (its own or a reused one)."""
    tracker = tracking_store(config).tracker()
    run_id = stage_run(tracker, tracker.experiment_id(config.campaign), parent, stage)
    return campaign_layout(config).stage_dir(stage, tracker.run(run_id).tags[TAG_INPUT_KEY])


def test_an_iteration_is_candidates_labels_reference_logprobs_and_a_dpo_update(campaign):
    for iteration in (0, 1):
        parent = resolve_run(campaign, f"{campaign.campaign}:{iteration}")
        ran = set(_children(campaign, parent))
        assert {"sample_candidates", "collect_preferences", "reference_logprobs", "dpo_update", "evaluate"} <= ran
        assert not ran & PPO_STAGES
        policy = _output(campaign, parent, "dpo_update")
        assert sorted(p.name for p in policy.iterdir() if p.is_dir()) == ["actor"]  # no critic, no optimizer states
    start = _output(campaign, resolve_run(campaign, f"{campaign.campaign}:0"), "initialize")
    assert not (start / "critic").exists()  # a DPO campaign makes none, whatever the (unused) estimator


def test_the_policy_moved_and_its_metrics_are_trls_and_finite(campaign, checkpoint_world):
    tracker = tracking_store(campaign).tracker()
    parent = resolve_run(campaign, f"{campaign.campaign}:1")
    metrics = tracker.run(parent).metrics
    for name in DPO_METRICS:
        assert math.isfinite(metrics[f"dpo_update/{name}"]), name
    assert math.isfinite(metrics["evaluate/kl_to_reference"]) and "evaluate/gold_win_rate" in metrics
    assert "evaluate/reward_mean" not in metrics  # no reward in a DPO campaign
    for iteration in (0, 1):
        run = tracker.run(resolve_run(campaign, f"{campaign.campaign}:{iteration}"))
        assert run.metrics["dpo_update/rewards/accuracies"] > 0.5, iteration  # on its training pairs, after it
    initial = AutoModelForCausalLM.from_pretrained(checkpoint_world["policy"]).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(_output(campaign, parent, "dpo_update") / "actor").state_dict()
    assert any(not torch.equal(initial[name], trained[name]) for name in initial)


def test_a_replay_with_another_beta_reruns_the_update_and_evaluation_on_the_stored_reference_logprobs(campaign):
    source = resolve_run(campaign, f"{campaign.campaign}:1")
    replay = replay_config(campaign, source, ["dpo.beta=0.5", "dpo.loss=ipo"])
    assert replay.dpo.beta == 0.5 and replay.sampling == campaign.sampling
    campaign_dir = campaign.run_root / campaign.campaign
    stored = sorted(p.name for p in (campaign_dir / "reference_logprobs").iterdir())

    replay_run = rlhf_replay(replay, source)

    assert sorted(_children(campaign, replay_run)) == ["dpo_update", "evaluate"]
    assert sorted(p.name for p in (campaign_dir / "reference_logprobs").iterdir()) == stored  # none computed again
    pairs = read_manifest(_output(campaign, source, "reference_logprobs"))
    update = read_manifest(_output(campaign, replay_run, "dpo_update"))
    assert update.upstream["pairs"] == pairs.digest  # the source's stored log-probs ...
    assert [model["role"] for model in update.runtime["models"]] == ["actor"]  # ... and no reference loaded
    tracker = tracking_store(campaign).tracker()
    before, after = tracker.run(source).metrics, tracker.run(replay_run).metrics
    assert after["dpo_update/rewards/margins"] != before["dpo_update/rewards/margins"]
    assert math.isfinite(after["evaluate/kl_to_reference"])

    table = compare_report(campaign, [source, replay_run], metrics=["dpo_update/rewards/margins"])
    assert "dpo_update/rewards/margins" in table and "registered" in table  # the policies as logged models


def test_the_dpo_policy_exports_as_a_plain_folder(campaign, tmp_path):
    folder = export_model(campaign, f"{campaign.campaign}:1", tmp_path / "exported")
    assert (folder / "config.json").is_file()


def test_offline_dpo_trains_every_iteration_on_the_imported_pairs_scored_once_by_the_reference(offline):
    config, pairs = offline
    first, second = _run(config, 0), _run(config, 1)
    for parent in (first, second):
        ran = set(_children(config, parent))
        assert "sample_candidates" not in ran and {"dpo_update", "evaluate"} <= ran
        for stage in ("collect_preferences", "reference_logprobs"):  # iteration 0's, once per campaign
            assert _output(config, parent, stage) == _output(config, first, stage), stage
    assert len(list((config.run_root / config.campaign / "reference_logprobs").iterdir())) == 1
    tracker = tracking_store(config).tracker()
    assert tracker.run(second).metrics["dpo_update/pairs"] == pairs  # all of the file's pairs, in each iteration
    updates = [read_manifest(_output(config, parent, "dpo_update")) for parent in (first, second)]
    assert updates[1].upstream["policy"] == updates[0].digest  # iteration 1 continues iteration 0's policy


def test_offline_dpo_on_an_online_iterations_pairs_trains_its_policy_bit_for_bit(campaign, offline):
    """The same pairs, seed and iteration: the update cannot tell an imported set from pairs it sampled."""
    config, _ = offline
    online = _output(campaign, _run(campaign, 0), "dpo_update") / "actor" / "model.safetensors"
    imported = _output(config, _run(config, 0), "dpo_update") / "actor" / "model.safetensors"
    assert online.read_bytes() == imported.read_bytes()


def test_inspect_shows_a_dpo_iteration_by_its_pairs_as_its_stages_measured_them(campaign, capsys):
    """The summary's DPO columns are the update's own TRL metrics and the reference stage's, recomputed per pair."""
    inspection = inspect_campaign(campaign, f"{campaign.campaign}:1", top=3)
    tracker = tracking_store(campaign).tracker()
    source = _run(campaign, 1)
    row = inspection.summary.filter(run="iteration").row(0, named=True)
    metrics = tracker.run(source).metrics
    assert row["estimator"] == "dpo sigmoid" and row["rollouts"] is None
    assert row["reward_accuracy"] == pytest.approx(metrics["dpo_update/rewards/accuracies"], abs=1e-6)
    assert row["reward_margin"] == pytest.approx(metrics["dpo_update/rewards/margins"], rel=1e-4)
    assert row["logps_chosen"] == pytest.approx(metrics["dpo_update/logps/chosen"], rel=1e-4)
    assert row["ref_logps_rejected"] == pytest.approx(metrics["reference_logprobs/logps/rejected"], rel=1e-4)
    assert inspection.summary.filter(run="iteration").height == 1  # (and the replay of it, where it ran first)
    pairs = inspection.responses
    assert pairs.height == 3 and pairs["reward_margin"].is_sorted(descending=True)
    labelled = read_table(_output(campaign, source, "collect_preferences"), "preferences").to_pylist()
    texts = {pair["pair_id"]: (pair["prompt"], pair["chosen"], pair["rejected"]) for pair in labelled}
    for pair in pairs.iter_rows(named=True):
        assert (pair["prompt"], pair["chosen"], pair["rejected"]) == texts[pair["pair_id"]]
        assert pair["reward_margin"] == pytest.approx(pair["rewards_chosen"] - pair["rewards_rejected"])
    printed = render_table(inspection)
    assert "DPO pairs" in printed and "scores and KL" not in printed and "implicit reward" in printed

    assert main(["inspect", campaign.campaign, "--top", "1", "--by", "score", f"--set=run_root={campaign.run_root}"])
    assert "is not a column of dpo-e2e's pairs" in capsys.readouterr().err


def test_each_dpo_iteration_run_carries_its_inspection_and_a_point_of_the_figure(campaign):
    tracker = tracking_store(campaign).tracker()
    for iteration in (0, 1):
        run = _run(campaign, iteration)
        assert "inspect/reward_accuracy" in tracker.run(run).metrics
        top = json.loads(tracker.load_text(run, TOP_PAIRS))
        assert {"chosen", "rejected", "rewards_chosen", "ref_logps_chosen"} <= set(top["columns"])
    rows = tracker.iteration_metrics(tracker.experiment_id(campaign.campaign))
    figure = overoptimisation_figure(rows, campaign=campaign.campaign)
    gold = figure.axes[0].get_lines()[0].get_xydata().tolist()  # the gold score against the KL, one point each
    assert gold == [[metrics[KL], metrics["evaluate/gold_mean"]] for _, metrics in rows] and len(gold) == 2
