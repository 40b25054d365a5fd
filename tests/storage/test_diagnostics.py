"""storage/diagnostics.py: each summary figure against values worked out by hand from four rollouts, the filters,
and the drift flags on a drifting and a steady campaign."""

from __future__ import annotations

import math

import polars as pl
import pyarrow as pa
import pytest

from storage.diagnostics import (
    DriftThresholds,
    describe_flag,
    drift_flags,
    filter_rollouts,
    group_spread,
    pair_frame,
    rollout_frame,
    summarize_evaluation,
    summarize_pairs,
    summarize_rollouts,
    top_rollouts,
)
from storage.schemas import SCORED_EXPERIENCE
from storage.shards import scan_table, write_shards

EOS = 2
# Four rollouts of two prompts, max_new_tokens 3. Per row: response ids, old and ref log-probs (so k1 = old - ref),
# score, per-token rewards and advantages; every value exact in float32.
ROLLOUTS = [
    # prompt 0: ends with EOS; k1 = [0.5, -0.25] -> kl 0.25, one negative token; reward 1.0
    dict(prompt_id=0, response_ids=[5, EOS], old=[-1.0, -0.5], ref=[-1.5, -0.25], score=1.0, rewards=[0.0, 1.0],
         advantages=[1.0, -1.0]),
    # prompt 0: 3 tokens and no EOS -> truncated; k1 = [0, 1, 0.5] -> kl 1.5; reward 2.0; same score as row 0
    dict(prompt_id=0, response_ids=[5, 6, 7], old=[-1.0, -1.0, -1.0], ref=[-1.0, -2.0, -1.5], score=1.0,
         rewards=[0.0, 0.0, 2.0], advantages=[2.0, 0.0, 0.0]),
    # prompt 1: EOS at once; k1 = [-0.25] -> kl -0.25, one negative token; reward -1.0
    dict(prompt_id=1, response_ids=[EOS], old=[-0.5], ref=[-0.25], score=-1.0, rewards=[-1.0], advantages=[-2.0]),
    # prompt 1: 3 tokens ending with EOS -> not truncated; k1 = 0; reward 0.5
    dict(prompt_id=1, response_ids=[7, 8, EOS], old=[-1.0, -1.0, -1.0], ref=[-1.0, -1.0, -1.0], score=0.5,
         rewards=[0.0, 0.0, 0.5], advantages=[1.0, 1.0, 1.0]),
]  # fmt: skip


def scored_table(rollouts: list[dict]) -> pa.Table:
    """A ``scored_experience`` table of ``rollouts`` (the per-token columns not set above are zeros)."""
    zeros = [[0.0] * len(r["response_ids"]) for r in rollouts]
    return pa.table(
        {
            "row": list(range(len(rollouts))),
            "prompt_id": [r["prompt_id"] for r in rollouts],
            "prompt_ids": [[1, 3] for _ in rollouts],
            "response_ids": [r["response_ids"] for r in rollouts],
            "old_logprobs": [r["old"] for r in rollouts],
            "ref_logprobs": [r["ref"] for r in rollouts],
            "old_values": zeros,
            "engine_logprobs": [None for _ in rollouts],  # sampled by hf: no engine log-probs
            "scores": [r["score"] for r in rollouts],
            "policy_version": [0 for _ in rollouts],
            "action_mask": [None for _ in rollouts],  # single-turn rows
            "turn_rewards": [None for _ in rollouts],
            "rewards": [r["rewards"] for r in rollouts],
            "kl": zeros,
            "advantages": [r["advantages"] for r in rollouts],
            "returns": zeros,
        }
    )


@pytest.fixture
def rollouts(tmp_path) -> pl.LazyFrame:
    # Two shards, so the scan joins files.
    write_shards(tmp_path, "scored_experience", scored_table(ROLLOUTS), schema=SCORED_EXPERIENCE, rows_per_shard=3)
    return rollout_frame(scan_table(tmp_path, "scored_experience"), max_new_tokens=3, eos_token_id=EOS)


def test_each_summary_figure_matches_the_hand_worked_value(rollouts):
    summary = summarize_rollouts(rollouts).collect().row(0, named=True)
    expected = {
        "rollouts": 4,
        "length_mean": 9 / 4,  # lengths 2, 3, 1, 3
        "length_p50": 2.5,  # sorted 1, 2, 3, 3: position 1.5 lies halfway between 2 and 3
        "length_p95": 3.0,  # position 0.95 * 3 = 2.85 lies between 3 and 3
        "truncated_share": 1 / 4,  # row 1 only: row 3 also has 3 tokens but ends with EOS
        "score_mean": 1.5 / 4,  # 1 + 1 - 1 + 0.5
        "score_std": math.sqrt((0.625**2 * 2 + 1.375**2 + 0.125**2) / 3),  # deviations from 0.375, ddof 1
        "reward_mean": 2.5 / 4,  # 1 + 2 - 1 + 0.5
        "reward_std": 1.25,  # deviations .375, 1.375, -1.625, -.125: squares sum to 4.6875; / 3 = 1.5625
        "kl_mean": 1.5 / 4,  # 0.25 + 1.5 - 0.25 + 0
        "negative_kl_share": 2 / 9,  # one token each in rows 0 and 2, of 9 tokens
        "advantage_mean": 3 / 9,  # tokens 1, -1, 2, 0, 0, -2, 1, 1, 1
        "advantage_std": math.sqrt((13 - 3**2 / 9) / 8),  # squares sum to 13
    }
    assert summary.keys() == expected.keys()
    for name, value in expected.items():
        assert summary[name] == pytest.approx(value, rel=1e-12), name


def test_per_rollout_figures(rollouts):
    frame = rollouts.collect()
    assert frame["length"].to_list() == [2, 3, 1, 3]
    assert frame["truncated"].to_list() == [False, True, False, False]
    assert frame["reward"].to_list() == [1.0, 2.0, -1.0, 0.5]
    assert frame["kl"].to_list() == [0.25, 1.5, -0.25, 0.0]
    assert frame["negative_kl_tokens"].to_list() == [1, 0, 1, 0]
    assert frame["advantage"].to_list() == pytest.approx([0.0, 2 / 3, -2.0, 1.0])


def test_without_an_eos_every_response_at_the_limit_counts_as_truncated(tmp_path):
    write_shards(tmp_path, "scored_experience", scored_table(ROLLOUTS), schema=SCORED_EXPERIENCE)
    frame = rollout_frame(scan_table(tmp_path, "scored_experience"), max_new_tokens=3, eos_token_id=None)
    assert frame.collect()["truncated"].to_list() == [False, True, False, True]


def test_zero_spread_share_counts_groups_whose_samples_scored_the_same(rollouts):
    # prompt 0 scored 1.0 twice (spread 0); prompt 1 scored -1.0 and 0.5 (spread 1.5)
    assert group_spread(rollouts).collect().item() == 0.5
    singles = rollouts.with_columns(pl.col("row").alias("prompt_id"))  # every prompt sampled once: no groups
    assert group_spread(singles).collect().item() is None


def test_evaluation_summary_with_and_without_a_gold_judge():
    with_gold = pl.LazyFrame({"policy_reward": [0.5, 1.5], "policy_gold": [-1.0, 0.0]})
    assert summarize_evaluation(with_gold).collect().row(0) == (1.0, -0.5)
    assert summarize_evaluation(with_gold.drop("policy_gold")).collect().row(0) == (1.0, None)


def test_where_filters_and_top_sorts(rollouts):
    assert filter_rollouts(rollouts, "length = 3 and score > 0").collect()["row"].to_list() == [1, 3]
    assert filter_rollouts(rollouts, None).collect().height == 4
    assert top_rollouts(rollouts, by="reward", count=2).collect()["row"].to_list() == [1, 0]
    assert top_rollouts(rollouts, by="score", count=3).collect()["row"].to_list() == [0, 1, 3]  # ties keep order


@pytest.mark.parametrize(
    ("where", "message"),
    [("length >>> 3", "not a SQL condition"), ("lenght > 3", "names no column lenght")],
)
def test_a_bad_where_is_one_clear_error(rollouts, where, message):
    with pytest.raises(ValueError, match=message):
        filter_rollouts(rollouts, where).collect()


def test_a_bad_by_names_the_columns(rollouts):
    with pytest.raises(ValueError, match="is not a column: choose one of row, prompt_id"):
        top_rollouts(rollouts, by="scores", count=1)


def _summary(**columns: list) -> pl.DataFrame:
    size = len(next(iter(columns.values())))
    return pl.DataFrame({"iteration": list(range(size)), "run": ["iteration"] * size, **columns})


STEADY = _summary(
    length_mean=[5.0, 5.1, 5.0, 5.2, 5.1],
    gold_mean=[0.0, 0.1, 0.2, 0.3, 0.4],
    kl_mean=[0.0, 0.2, 0.4, 0.6, 0.8],
    score_mean=[0.0, 0.3, 0.6, 0.9, 1.2],
    heldout_score_mean=[0.0, 0.1, 0.2, 0.3, 0.4],
    entropy=[2.0, 1.9, 1.8, 1.7, 1.6],
)


def test_a_steady_campaign_raises_no_flag():
    assert drift_flags(STEADY) == []


def test_a_drifting_campaign_raises_each_flag_naming_its_iterations_and_figures():
    drifting = _summary(
        length_mean=[5.0, 5.0, 5.0, 7.0, 9.0],  # +40% over iterations 1-3, +80% over 2-4
        gold_mean=[0.0, 0.2, 0.2, 0.2, 0.1],  # gains 0.2 over 0-2, then 0.0 over 1-3 and -0.1 over 2-4: stalls
        kl_mean=[0.0, 0.1, 0.2, 1.5, 4.0],  # +1.3 nats over 1-3 and +3.8 over 2-4
        score_mean=[0.0, 0.2, 0.4, 0.6, 0.7],  # +0.4 and +0.3 meanwhile
        heldout_score_mean=[0.0, 0.1, 0.2, 0.5, 0.9],
        entropy=[2.0, 1.8, 1.5, 0.9, 0.5],  # below half of 2.0 at iterations 3 and 4
    )
    flags = {flag.kind: flag for flag in drift_flags(drifting)}
    assert sorted(flags) == ["entropy", "kl", "length", "reward_model"]
    assert (flags["length"].first, flags["length"].last) == (1, 4)  # flagged at 3 and 4, window 2
    assert describe_flag(flags["length"]) == (
        "iterations 1-4: response length climbed +80% (5 -> 9) while the gold score stalled (-0.1 (0.2 -> 0.1))"
    )
    assert (flags["kl"].first, flags["kl"].last) == (1, 4) and "KL +3.9 (0.1 -> 4) nats" in flags["kl"].message
    assert (flags["reward_model"].first, flags["reward_model"].last) == (1, 4)
    assert (flags["entropy"].first, flags["entropy"].last) == (3, 4)
    assert "0.5 at iteration 4, 25% of iteration 0's 2" in flags["entropy"].message


def test_flags_follow_their_thresholds_and_skip_missing_columns():
    lengths = _summary(length_mean=[5.0, 5.5], gold_mean=[0.0, 0.0])  # +10%, gold flat; window shrinks to 1
    assert drift_flags(lengths) == []
    assert [flag.kind for flag in drift_flags(lengths, DriftThresholds.parse(["length_rise=0.1"]))] == ["length"]
    no_gold = _summary(length_mean=[5.0, 9.0], gold_mean=[None, None])
    assert drift_flags(no_gold) == []
    replay = pl.concat([lengths, lengths.with_columns(run=pl.lit("replay abc"))])
    assert drift_flags(replay, DriftThresholds(length_rise=0.1))[0].last == 1  # replays are not iterations


@pytest.mark.parametrize(
    ("setting", "message"),
    [("windw=2", "no threshold 'windw'"), ("kl_rise=lots", "'lots' is not a number"), ("window=0", "at least 1")],
)
def test_bad_thresholds_are_named(setting, message):
    with pytest.raises(ValueError, match=message):
        DriftThresholds.parse([setting])


def test_a_dpo_updates_pairs_and_their_summary_by_hand():
    """Two pairs (ids 7 and 3; the update's table in another order, with a pair the reference never scored): the
    reference's log-probs joined to the policy's by pair id, in the reference's order."""
    reference = pl.LazyFrame(
        {
            "pair_id": [7, 3],
            "ref_logprobs_chosen": [-4.0, -2.0],
            "ref_logprobs_rejected": [-3.0, -1.0],
            "chosen_tokens": [2, 1],
            "rejected_tokens": [3, 2],
        }
    )
    measures = pl.LazyFrame(
        {
            "pair_id": [3, 9, 7],
            "logps_chosen": [-1.0, 0.0, -3.0],
            "logps_rejected": [-1.5, 0.0, -3.5],
            "rewards_chosen": [0.1, 0.0, 0.1],
            "rewards_rejected": [-0.05, 0.0, 0.15],
        }
    )
    pairs = pair_frame(reference, measures).collect()
    assert pairs["pair_id"].to_list() == [7, 3]
    assert pairs["reward_margin"].to_list() == pytest.approx([-0.05, 0.15])  # 0.1 - 0.15; 0.1 + 0.05
    assert pairs["ref_logps_chosen"].to_list() == [-4.0, -2.0] and pairs["logps_rejected"].to_list() == [-3.5, -1.5]
    summary = summarize_pairs(pairs.lazy()).collect().row(0, named=True)
    assert summary == pytest.approx(
        {
            "logps_chosen": -2.0,
            "logps_rejected": -2.5,
            "ref_logps_chosen": -3.0,
            "ref_logps_rejected": -2.0,
            "reward_margin": 0.05,
            "reward_accuracy": 0.5,
        }
    )


def test_an_episodes_figures_count_the_models_tokens_only(tmp_path):
    """An episode's row (``action_mask``): the environment's tokens between its turns count in no length, KL or
    advantage, whatever log-probs sit there; a failed episode (mask all False) has no model token."""
    episodes = [
        # two model turns (5 EOS, 6 EOS) around the environment's reply (9 9), whose k1 is 3.0 and -4.0
        dict(prompt_id=0, response_ids=[5, EOS, 9, 9, 6, EOS], old=[-1.0, -1.0, 0.0, 0.0, -1.0, -1.0],
             ref=[-1.5, -1.0, -3.0, 4.0, -0.75, -1.0], score=1.0, rewards=[0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
             advantages=[1.0, 1.0, 0.0, 0.0, 2.0, 2.0]),
        dict(prompt_id=0, response_ids=[5, 6, 7], old=[-1.0, -1.0, -1.0], ref=[-2.0, -2.0, -2.0], score=0.0,
             rewards=[0.0, 0.0, 0.0], advantages=[0.0, 0.0, 0.0]),  # its environment failed: out of the loss
    ]  # fmt: skip
    table = scored_table(episodes)
    masks = pa.array([[True, True, False, False, True, True], [False, False, False]], type=pa.list_(pa.bool_()))
    table = table.set_column(table.schema.get_field_index("action_mask"), "action_mask", masks)
    write_shards(tmp_path, "scored_experience", table, schema=SCORED_EXPERIENCE)
    frame = rollout_frame(scan_table(tmp_path, "scored_experience"), max_new_tokens=3, eos_token_id=EOS).collect()
    assert frame["length"].to_list() == [4, 0]  # the model's 4 tokens; the failed episode's none
    assert frame["kl"].to_list() == [0.25, 0.0]  # k1 0.5, 0, -0.25, 0 at the model's tokens
    assert frame["negative_kl_tokens"].to_list() == [1, 0]
    assert frame["advantage"].to_list() == [6 / 4, None]  # (1 + 1 + 2 + 2) / 4; none without a model token
    assert frame["truncated"].to_list() == [False, False]  # 3 tokens, no EOS, but an episode: its turns say
