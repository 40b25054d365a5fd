"""Issue 43, enough decisive pairs by itself (flows/rounds.py): an iteration that labelled fewer decisive pairs than
`sizes.decisive_pairs` samples another round of fresh prompts, up to `sizes.max_rounds`.

The flow test runs one iteration of the tiny campaign on a sparse rubric (`tests.flows.rewards:says_happy`: most
candidates tie), whose first round is short of the pairs asked for and whose second tops it up."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from campaign.config import IterationSizes, load_config
from campaign.store import resolve_run
from flows.iterations import tracking_store
from flows.rlhf_pipeline import rlhf_campaign
from flows.rounds import Round, round_metrics, shortfall, wants_another_round
from runtime.declaration import StageResult
from storage.manifest import read_manifest

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _labelled(decisive: float, ties: float = 0.0) -> StageResult:
    return StageResult("collect_preferences", "", "", "", False, None, {"decisive_pairs": decisive, "ties": ties})


def _sampled(candidates: float) -> StageResult:
    return StageResult("sample_candidates", "", "", "", False, None, {"candidates": candidates})


def test_rounds_go_on_while_short_of_the_decisive_pairs_asked_and_within_the_budget():
    sizes = IterationSizes(decisive_pairs=8, max_rounds=2)
    assert wants_another_round([], sizes)  # the first round always runs
    assert wants_another_round([Round(None, _labelled(5))], sizes)  # 5 < 8, 1 round of 2
    assert not wants_another_round([Round(None, _labelled(5)), Round(None, _labelled(1))], sizes)  # budget spent
    assert not wants_another_round([Round(None, _labelled(8))], sizes)  # enough
    assert not wants_another_round([Round(None, _labelled(0))], IterationSizes())  # none asked for: one round
    short = shortfall([Round(None, _labelled(5)), Round(None, _labelled(1))], sizes)
    assert short is not None and short.startswith("6 decisive pairs of the 8 asked for") and "2 rounds" in short
    assert shortfall([Round(None, _labelled(9))], sizes) is None and shortfall([], IterationSizes()) is None


def test_the_rounds_metrics_add_up_the_rounds():
    stages = [_sampled(16), _labelled(3, ties=21), _sampled(16), _labelled(4, ties=20)]
    assert round_metrics(stages, IterationSizes(decisive_pairs=6)) == {
        "rounds/rounds": 2.0,
        "rounds/candidates": 32.0,
        "rounds/decisive_pairs": 7.0,
        "rounds/ties": 41.0,
        "rounds/pairs_per_candidate": 7 / 32,
        "rounds/short": 0.0,
    }
    assert round_metrics(stages, IterationSizes(decisive_pairs=8))["rounds/short"] == 1.0
    assert round_metrics([_labelled(4)], IterationSizes()) == {}  # imported pairs: no candidates, no rounds


def _outputs(config, stage: str) -> list[Path]:
    folder = config.run_root / config.campaign / stage
    return [path for path in folder.iterdir() if (path / "_manifest.json").is_file()]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "_manifest.json").read_text())


def _digest(folder: Path) -> str:
    return read_manifest(folder, verify=False).digest


def _column(folder: Path, table: str, column: str) -> list:
    return [
        value for path in sorted(folder.glob(f"{table}-*.parquet")) for value in pq.read_table(path)[column].to_pylist()
    ]


SPARSE_ROUNDS = [
    "iterations=1", "labeler=function", "reward.function=tests.flows.rewards:says_happy", "pairing=all_decisive",
    "sizes.preference_prompts=4", "sizes.candidates_per_prompt=4", "sizes.rollout_prompts=4", "sizes.eval_prompts=4",
    "sizes.decisive_pairs=12", "sizes.max_rounds=3",
]  # fmt: skip
"""One iteration of the tiny campaign on a sparse rubric whose first round of candidates is short of the decisive
pairs asked for, so that a second round of fresh prompts runs (also tests/flows/test_crash.py's kill between rounds)."""


@pytest.fixture(scope="module")
def sparse(prefect_server, checkpoint_world, tmp_path_factory):
    """One iteration on the sparse rubric: 4 prompts x 4 candidates a round, every decisive pair kept, 12 asked for.
    Its first round labels 9 decisive pairs (15 of its 24 compared pairs tie), its second 3 more."""
    root = tmp_path_factory.mktemp("rounds")
    config = load_config(
        TINY,
        [
            f"run_root={root}",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
            "campaign=sparse",
            *SPARSE_ROUNDS,
        ],
    )
    rlhf_campaign(config)
    return config


def test_a_short_first_round_is_topped_up_by_a_round_of_fresh_prompts(sparse):
    first, second = sorted(_outputs(sparse, "sample_candidates"), key=lambda path: _manifest(path)["metrics"]["round"])
    assert [_manifest(path)["metrics"]["round"] for path in (first, second)] == [0, 1]  # no third: 12 reached
    # Round 1 (index 0) takes the iteration's prompts, 0-3; round 2 the next 4 of the rotation: none sampled before.
    assert sorted(set(_column(first, "candidates", "prompt_id"))) == [0, 1, 2, 3]
    assert sorted(set(_column(second, "candidates", "prompt_id"))) == [4, 5, 6, 7]
    assert _manifest(second)["upstream"] == {
        "policy": _manifest(first)["upstream"]["policy"],
        "earlier_0": _digest(first),
    }
    labels = {_manifest(path)["upstream"]["candidates"]: path for path in _outputs(sparse, "collect_preferences")}
    labelled = [labels[_digest(first)], labels[_digest(second)]]
    assert [_manifest(path)["metrics"]["decisive_pairs"] for path in labelled] == [9, 3]  # 9 < 12 <= 9 + 3
    assert [_manifest(path)["metrics"]["ties"] for path in labelled] == [15, 21]  # of 4 x 6 compared pairs each
    # Pair ids go on from the first round's: one id per pair across the iteration.
    assert _column(labelled[0], "preferences", "pair_id") + _column(labelled[1], "preferences", "pair_id") == list(
        range(12)
    )
    # The reward model learns from both rounds' pairs.
    (reward_model,) = _outputs(sparse, "train_reward_model")
    assert _manifest(reward_model)["metrics"]["pairs"] == 12
    assert [_manifest(reward_model)["upstream"][f"preferences_{i}"] for i in range(2)] == [
        _digest(path) for path in labelled
    ]
    metrics = tracking_store(sparse).tracker().run(resolve_run(sparse, "sparse:0")).metrics
    assert {name: value for name, value in metrics.items() if name.startswith("rounds/")} == {
        "rounds/rounds": 2.0,
        "rounds/candidates": 32.0,
        "rounds/decisive_pairs": 12.0,
        "rounds/ties": 36.0,
        "rounds/pairs_per_candidate": 12 / 32,
        "rounds/short": 0.0,
    }
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:  # the iteration's summary artifact says them too
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sparse-iteration-0"])), limit=1
        )
    assert "| rounds/rounds | 2 |" in artifact.data and "| rounds/decisive_pairs | 12 |" in artifact.data


def test_a_rerun_of_the_iteration_reuses_both_rounds(sparse):
    before = {stage: sorted(_outputs(sparse, stage)) for stage in ("sample_candidates", "collect_preferences")}
    rlhf_campaign(sparse, from_iteration=0)  # recomputes iteration 0 in a new run: every output is found
    assert {stage: sorted(_outputs(sparse, stage)) for stage in before} == before
    tracker = tracking_store(sparse).tracker()
    run = tracker.run(resolve_run(sparse, "sparse:0"))
    assert run.metrics["rounds/rounds"] == 2.0 and run.metrics["rounds/decisive_pairs"] == 12.0
