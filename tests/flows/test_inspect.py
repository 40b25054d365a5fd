"""``rlhf inspect`` on a real tiny campaign (and a replay of it under another estimator) and on constructed drifting
and steady campaigns; the summary logged on each iteration's MLflow run. The summary's maths is pinned by hand in
tests/storage/test_diagnostics.py; here each column is checked against what the stages themselves measured."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest

from bench.inspect_scale import write_synthetic_campaign
from campaign.config import load_config
from campaign.store import resolve_run
from flows.cli import main
from flows.inspection import TOP_RESPONSES
from flows.iterations import tracking_store
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_replay
from storage.shards import read_table
from storage.tokenizers import load_tokenizer
from storage.tracking import TAG_OUTPUT_PATH, TAG_OUTPUT_PREFIX

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def recorded(prefect_server, checkpoint_world, tmp_path_factory):
    """The tiny campaign with two samples per prompt (groups, so GRPO can replay it), and a GRPO replay of
    iteration 1."""
    config = load_config(
        TINY,
        [
            f"run_root={tmp_path_factory.mktemp('inspect-runs')}",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
            "sizes.samples_per_prompt=2",
        ],
    )
    rlhf_campaign(config)
    source = resolve_run(config, f"{config.campaign}:1")
    replay = rlhf_replay(replay_config(config, source, ["advantages.estimator=grpo"]), source)
    return config, source, replay


def _inspect(config, capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv, f"--set=run_root={config.run_root}"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _json(config, capsys, *argv: str) -> dict:
    code, out, err = _inspect(config, capsys, *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def _output(tracker, run_id: str, stage: str) -> Path:
    stage_run = tracker.run(run_id).tags[f"{TAG_OUTPUT_PREFIX}{stage}"]
    return Path(tracker.run(stage_run).tags[TAG_OUTPUT_PATH])


def test_each_column_agrees_with_what_the_stages_measured(recorded, capsys):
    config, source, replay = recorded
    tracker = tracking_store(config).tracker()
    rows = _json(config, capsys, config.campaign)["summary"]
    assert [(row["iteration"], row["run"]) for row in rows] == [
        (0, "iteration"),
        (1, "iteration"),
        (1, f"replay {replay[:12]}"),
    ]
    for row, run_id in zip(rows, [resolve_run(config, f"{config.campaign}:0"), source, replay], strict=True):
        metrics = tracker.run(run_id).metrics
        if row["run"] == "iteration":  # the replay's experience is its source's: the rollout metrics are there
            assert row["rollouts"] == metrics["rollout/rollouts"] == 32
            assert row["length_mean"] == pytest.approx(metrics["rollout/response_length_mean"], rel=1e-6)
            assert row["score_mean"] == pytest.approx(metrics["rollout/score_mean"], rel=1e-5)
            assert row["rm_accuracy"] == metrics["train_reward_model/eval_accuracy"]
            assert row["candidates"] == metrics["sample_candidates/candidates"]
            assert row["pairs"] == metrics["collect_preferences/pairs"]
        assert row["reward_mean"] == pytest.approx(metrics["compute_advantages/reward_mean"], rel=1e-5, abs=1e-6)
        assert row["kl_mean"] == pytest.approx(metrics["compute_advantages/kl_mean"], rel=1e-4, abs=1e-6)  # k1
        assert row["advantage_mean"] == pytest.approx(metrics["compute_advantages/advantage_mean"], rel=1e-5, abs=1e-6)
        assert row["entropy"] == pytest.approx(metrics["ppo_update/entropy"])
        assert row["heldout_score_mean"] == pytest.approx(metrics["evaluate/reward_mean"])
        assert row["gold_mean"] == pytest.approx(metrics["evaluate/gold_mean"])
        # and the figures no stage reports, from the shards themselves
        table = read_table(_output(tracker, run_id, "compute_advantages"), "scored_experience")
        lengths = pc.list_value_length(table.column("response_ids")).to_pylist()
        assert row["length_p95"] >= row["length_p50"] and max(lengths) >= row["length_p95"]
        assert row["truncated_share"] <= sum(n == config.sampling.max_new_tokens for n in lengths) / len(lengths)
        assert 0 <= row["negative_kl_share"] <= 1 and row["advantage_std"] > 0
        assert row["zero_spread_share"] is not None  # two samples per prompt
    source_row, replay_row = rows[1], rows[2]
    assert (source_row["estimator"], replay_row["estimator"]) == ("gae", "grpo")
    for same in ("rollouts", "length_mean", "score_mean", "kl_mean", "zero_spread_share", "rm_accuracy"):
        assert replay_row[same] == source_row[same], same
    assert replay_row["advantage_std"] != source_row["advantage_std"]


def test_top_and_where_print_responses_decoded_with_the_campaigns_tokenizer(recorded, capsys, checkpoint_world):
    config, source, replay = recorded
    tracker = tracking_store(config).tracker()
    responses = _json(config, capsys, f"{config.campaign}:1", "--top", "3", "--by", "reward")["responses"]
    assert len(responses) == 3
    assert [r["reward"] for r in responses] == sorted((r["reward"] for r in responses), reverse=True)
    tokenizer = load_tokenizer(checkpoint_world["policy"])
    for response in responses:
        run_id = source if response["run"] == "iteration" else replay
        table = read_table(_output(tracker, run_id, "compute_advantages"), "scored_experience").to_pylist()
        stored = table[response["row"]]
        assert stored["row"] == response["row"]
        assert response["response"] == tokenizer.decode(stored["response_ids"], skip_special_tokens=True)
        assert response["prompt"] == tokenizer.decode(stored["prompt_ids"], skip_special_tokens=True)
        assert response["length"] == len(stored["response_ids"])
    # One rollout under both estimators, row by row: the same response, scored alike, with other advantages.
    same_row = _json(config, capsys, f"{config.campaign}:1", "--where", "row = 3")["responses"]
    assert [r["run"] for r in same_row] == ["iteration", f"replay {replay[:12]}"]
    assert same_row[0]["response"] == same_row[1]["response"] and same_row[0]["score"] == same_row[1]["score"]
    assert same_row[0]["advantage"] != same_row[1]["advantage"]
    long_ones = _json(config, capsys, config.campaign, "--where", "length >= 6 and run = 'iteration'")["responses"]
    assert long_ones and all(r["length"] >= 6 and r["run"] == "iteration" for r in long_ones)


def test_table_and_csv_formats(recorded, capsys):
    config, _, _ = recorded
    code, out, _ = _inspect(config, capsys, config.campaign, "--top", "1")
    assert code == 0
    for words in ("experience:", "scores and KL:", "drift warnings", "truncated_share", "gold_mean", "response: "):
        assert words in out
    code, out, _ = _inspect(config, capsys, f"{config.campaign}:0", "--format", "csv")
    header, *lines = out.splitlines()
    assert code == 0 and header.startswith("iteration,run,estimator,candidates,pairs,rollouts") and len(lines) == 1


def test_each_iteration_run_carries_its_summary_and_top_responses_in_mlflow(recorded):
    config, source, replay = recorded
    tracker = tracking_store(config).tracker()
    for run_id in (source, replay):
        metrics = tracker.run(run_id).metrics
        assert metrics["inspect/rollouts"] == 32 and "inspect/gold_mean" in metrics
        top = json.loads(tracker.load_text(run_id, TOP_RESPONSES))
        assert "response" in top["columns"] and len(top["data"]) == 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-campaign"], "no campaign 'no-such-campaign'"),
        (["{campaign}:7"], "has no finished iteration 7"),
        (["{campaign}:one"], "is not CAMPAIGN or CAMPAIGN:ITERATION"),
        (["{campaign}", "--where", "lenght > 3"], "names no column lenght"),
        (["{campaign}", "--where", "length >>> 3"], "is not a SQL condition"),
        (["{campaign}", "--where", "run > 3"], "cannot be evaluated: cannot compare string"),
        (["{campaign}", "--top", "2", "--by", "gold"], "`--by` 'gold' is not a rollout column"),
        (["{campaign}", "--threshold", "window=0"], "at least 1"),
    ],
)
def test_what_does_not_exist_or_parse_is_one_line_and_exit_2(recorded, capsys, argv, message):
    config, _, _ = recorded
    code, out, err = _inspect(config, capsys, *(arg.format(campaign=config.campaign) for arg in argv))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_no_store_at_all_is_one_line_and_creates_none(tmp_path, capsys):
    assert main(["inspect", "tiny", f"--set=run_root={tmp_path}"]) == 2
    assert "no MLflow store" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_flags_a_drifting_campaign_and_not_a_steady_one(tmp_path, capsys):
    for name, drift in (("drifting", True), ("steady", False)):
        write_synthetic_campaign(tmp_path, name, iterations=6, rollouts=64, drift=drift)
    config = load_config(None, [f"run_root={tmp_path}"], store_only=True)
    assert _json(config, capsys, "steady")["flags"] == []
    flags = {flag["kind"]: flag for flag in _json(config, capsys, "drifting")["flags"]}
    assert sorted(flags) == ["entropy", "kl", "length", "reward_model"]
    assert (flags["length"]["first"], flags["length"]["last"]) == (1, 5)
    assert (
        "response length climbed" in flags["length"]["message"] and "gold score stalled" in flags["length"]["message"]
    )
    assert (flags["entropy"]["first"], flags["entropy"]["last"]) == (3, 5)
    code, out, _ = _inspect(config, capsys, "drifting")
    assert "drift warnings:\n  length: iterations 1-5: response length climbed" in out
    relaxed = _json(config, capsys, "drifting", "--threshold", "length_rise=5", "--threshold", "kl_rise=100")["flags"]
    assert {flag["kind"] for flag in relaxed} == {"entropy", "reward_model"}


def test_the_prefect_artifact_shows_the_top_responses_and_lists_the_drift_warnings(recorded):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    config, _, _ = recorded
    with get_client(sync_client=True) as client:
        for kind in ("iteration", "replay"):
            key = f"{config.campaign}-{kind}-1"
            (artifact,) = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1
            )
            assert (
                f"`{TOP_RESPONSES}` table" in artifact.data
                and "| score | reward | KL | length | response |" in artifact.data
            )
            assert f"`rlhf inspect {config.campaign}:1 --top 10`" in artifact.data
            assert ("Drift warnings" in artifact.data) == (kind == "iteration")  # a campaign's, not a replay's
