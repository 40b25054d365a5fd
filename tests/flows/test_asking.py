"""Issue 43, labels that teach the most (`asking`): a campaign that continues the shared one-iteration campaign
asking about 8 of iteration 1's 16 compared pairs, the 2 held-out ones drawn at random, the 6 others those iteration
0's reward model is least sure of; the reward model holds out the 2 and trains on the 6."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.rlhf_pipeline import rlhf_campaign
from rlhf_core.loading import ModelLoader
from runtime.seeds import stage_seed
from storage.manifest import read_manifest
from storage.shards import read_table
from tasks.collect_preferences import candidate_pairs
from tasks.labelers import RewardModelLabeler
from tasks.pairing import HELD_OUT_HEAD, askable_pairs, asked_pairs
from tasks.tensors import reward_scorer
from tests.flows.campaigns import copy_campaign, tiny_config


def _outputs(config, stage: str) -> dict[str, Path]:
    """The stage's outputs by digest."""
    folder = config.run_root / config.campaign / stage
    return {
        read_manifest(path, verify=False).digest: path
        for path in folder.iterdir()
        if (path / "_manifest.json").is_file()
    }


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "_manifest.json").read_text())


def _with_upstream(outputs: dict[str, Path], name: str) -> Path:
    """The one output of iteration 1 among ``outputs``: the one with the upstream ``name`` (iteration 0 had none)."""
    (folder,) = [path for path in outputs.values() if name in _manifest(path)["upstream"]]
    return folder


@pytest.fixture(scope="module")
def asked(prefect_server, one_iteration_campaign, checkpoint_world, tmp_path_factory):
    run_root = copy_campaign(one_iteration_campaign.run_root, tmp_path_factory.mktemp("asking") / "runs")
    config = tiny_config(run_root, checkpoint_world, "iterations=2", "asking.select=uncertain", "asking.pairs=8")
    rlhf_campaign(config)
    return config, checkpoint_world


def test_issue43_iteration_1_asks_about_a_random_held_out_draw_and_the_pairs_its_reward_model_is_least_sure_of(asked):
    config, world = asked
    preferences, candidates = _outputs(config, "collect_preferences"), _outputs(config, "sample_candidates")
    reward_models = _outputs(config, "train_reward_model")
    labelled = _with_upstream(preferences, "reward_model")  # keyed by iteration 0's reward model
    manifest = _manifest(labelled)
    judge = reward_models[manifest["upstream"]["reward_model"]]
    assert "previous" not in _manifest(judge)["upstream"]  # iteration 0's
    assert {name: manifest["metrics"][name] for name in ("compared_pairs", "asked_pairs", HELD_OUT_HEAD)} == {
        "compared_pairs": 16.0,
        "asked_pairs": 8.0,
        HELD_OUT_HEAD: 2.0,  # ceil(8 x 0.25)
    }
    # Iteration 0's reward model's margins on iteration 1's consecutive pairs, as the stage computed them; a pair of
    # two identical responses is never asked about.
    pairs = candidate_pairs(read_table(candidates[manifest["upstream"]["candidates"]], "candidates"))
    askable = askable_pairs(pairs)
    model = ModelLoader(device="cpu", precision="fp32").load("reward_model", judge / "reward_model")
    scorer = reward_scorer(model, policy_tokenizer_dir=str(world["policy"]), reward_tokenizer_dir=str(world["policy"]))
    margins = [label.margin for label in RewardModelLabeler(scorer).label([pairs[index] for index in askable])]
    seed = stage_seed(config.seed, "collect_preferences", 1)
    drawn, by_margin = asked_pairs(len(askable), margins, budget=8, held_out=2, seed=seed)
    # The held-out pairs are the seed's draw alone: any margins (none at all) draw the same ones.
    assert drawn == asked_pairs(len(askable), None, budget=8, held_out=2, seed=seed).held_out
    # The chosen ones have the smallest margins of the pairs not held out (to float noise between two runs).
    left_out = set(range(len(askable))) - set(drawn) - set(by_margin)
    assert max(margins[index] for index in by_margin) <= min(margins[index] for index in left_out) + 1e-6
    held_out, chosen = [askable[index] for index in drawn], [askable[index] for index in by_margin]
    # The preference table asks in that order, held-out pairs first; the gold labeler kept every asked pair.
    table = pq.read_table(sorted(labelled.glob("preferences-*.parquet")))
    asked_responses = [{pairs[index].first, pairs[index].second} for index in [*held_out, *chosen]]
    assert [{row["chosen"], row["rejected"]} for row in table.to_pylist()] == asked_responses


def test_issue43_the_reward_model_holds_out_the_random_draw_and_trains_on_the_pairs_chosen_by_margin(asked):
    config, _ = asked
    trained = _manifest(_with_upstream(_outputs(config, "train_reward_model"), "previous"))["metrics"]
    # Iteration 0: 16 pairs, 4 held out (every pair asked); iteration 1: 8 asked, its 2 random ones held out.
    assert (trained["pairs"], trained["eval_pairs"], trained["train_pairs"]) == (24.0, 6.0, 18.0)
