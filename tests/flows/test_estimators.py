"""Issue 12 end to end: the tiny campaign with a critic-free group estimator and the adaptive KL controller,
with a reward function instead of a reward model, and replays of one saved experience under every estimator.

Three campaigns share one run root (one MLflow store): GRPO with a reward model learned from a rubric's labels
(issue 23), REINFORCE++ with a reward function, and one on groups with a reward function, run under RLOO and then
recomputed under Dr. GRPO, whose stages before the advantages the second command finds rather than recomputes (the
estimator is a setting a campaign may change from one command to the next)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from torch.distributed.checkpoint import FileSystemReader

from campaign.config import ConfigError, load_config
from campaign.store import resolve_run
from flows.iterations import load_latest_state, resolve_base, tracking_store
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_replay
from runtime.checkpointer import OPTIMIZERS
from runtime.references import RewardFunctionError

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _world(checkpoint_world, run_root) -> list[str]:
    return [
        f"run_root={run_root}",
        f"model.policy={checkpoint_world['policy']}",
        f"data.prompts={checkpoint_world['prompts']}",
        f"data.eval_prompts={checkpoint_world['eval_prompts']}",
    ]


def _outputs(config, stage: str) -> list[Path]:
    return sorted(p for p in (config.run_root / config.campaign / stage).iterdir() if (p / "_manifest.json").is_file())


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "_manifest.json").read_text())


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """The run root of every campaign here."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def grouped(prefect_server, checkpoint_world, run_root):
    """GRPO on groups of 2 (8 prompts x 2 = 16 rollouts), a reward model learned from the pairs a rubric labels
    (`labeler: function`, the longer response preferred), adaptive KL, two iterations."""
    overrides = [
        *_world(checkpoint_world, run_root),
        "campaign=grpo",
        "labeler=function",
        "reward.function=tests.flows.rewards:length_score",
        "advantages.estimator=grpo",
        "sizes.samples_per_prompt=2",
        "sizes.rollout_prompts=8",
        "advantages.kl_target=0.5",
        "advantages.kl_horizon=16",  # one iteration's rollouts: the controller moves by its whole clip
        "advantages.kl_coef=0.1",
    ]
    config = load_config(TINY, overrides)
    rlhf_campaign(config)
    return config


def test_a_critic_free_campaign_never_makes_loads_or_trains_a_critic(grouped):
    (start,) = _outputs(grouped, "initialize")
    assert not (start / "critic").exists() and (start / "actor").is_dir()
    updates = _outputs(grouped, "ppo_update")
    assert len(updates) == grouped.iterations
    for update in updates:
        assert not (update / "critic").exists()
        assert "value_loss" not in _manifest(update)["metrics"]
        assert {model["role"] for model in _manifest(update)["runtime"]["models"]} == {"actor"}
    (kept,) = (update / OPTIMIZERS for update in updates if (update / OPTIMIZERS).is_dir())  # the newest's only
    saved = FileSystemReader(kept).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in saved} == {"actor"}, "no critic optimizer state either"
    tracker = tracking_store(grouped).tracker()
    assert tracker.model_versions("grpo-critic") == [] and len(tracker.model_versions("grpo-actor")) == 2
    for rollout in _outputs(grouped, "rollout"):
        assert "critic" not in {model["role"] for model in _manifest(rollout)["runtime"]["models"]}
        table = pq.read_table(next(rollout.glob("experience-*.parquet")))
        assert table.column("old_values").null_count == table.num_rows == 16
        # Every prompt's two samples are a group: its id appears exactly twice.
        ids = table.column("prompt_id").to_pylist()
        assert sorted(ids.count(prompt) for prompt in set(ids)) == [2] * 8


def test_the_adaptive_kl_coefficient_carries_to_the_next_iteration_and_to_a_continuation(grouped):
    tracker = tracking_store(grouped).tracker()
    first, second = (tracker.run(resolve_run(grouped, f"grpo:{i}")).metrics for i in range(2))
    assert first["compute_advantages/kl_coef"] == 0.1
    # Iteration 0 rolls out the reference itself: KL about 0, so the error clips at -0.2, and with
    # steps / horizon = 16 / 16 the next coefficient is 0.1 * (1 - 0.2) = 0.08.
    assert abs(first["compute_advantages/kl_mean"]) < 1e-5  # 0 up to the sampler's float rounding
    assert first["compute_advantages/next_kl_coef"] == pytest.approx(0.08, rel=1e-12)
    assert second["compute_advantages/kl_coef"] == first["compute_advantages/next_kl_coef"]
    # Continuing the campaign starts from the last iteration's scored experience.
    _, state = load_latest_state.fn(grouped, resolve_base.fn(grouped))
    assert (
        state.reward_model is not None and state.advantages.metrics["kl_coef"] == second["compute_advantages/kl_coef"]
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["advantages.estimator=rloo"],
        ["advantages.estimator=dr_grpo", "ppo.aggregation=token_sum_norm"],
        ["advantages.estimator=reinforce_pp"],
        ["advantages.kl_in=loss", "advantages.kl_target=null", "ppo.kl_loss_coef=0.1"],
    ],
    ids=["rloo", "dr_grpo", "reinforce_pp", "grpo-kl-in-loss"],
)
def test_one_saved_experience_replays_under_another_estimator(grouped, overrides):
    source = resolve_run(grouped, "grpo:1")
    rollouts_before = _outputs(grouped, "rollout")
    replay_run = rlhf_replay(replay_config(grouped, source, overrides), source)
    tracker = tracking_store(grouped).tracker()
    tags, metrics, source_metrics = (
        tracker.run(replay_run).tags,
        tracker.run(replay_run).metrics,
        tracker.run(source).metrics,
    )
    assert tags["rlhf.replay_of"] == source and _outputs(grouped, "rollout") == rollouts_before  # nothing generated
    assert metrics["compute_advantages/advantage_mean"] != source_metrics["compute_advantages/advantage_mean"]
    assert metrics["ppo_update/optimizer_steps"] == source_metrics["ppo_update/optimizer_steps"]
    assert "evaluate/gold_win_rate" not in metrics or 0.0 <= metrics["evaluate/gold_win_rate"] <= 1.0
    if "advantages.kl_in=loss" in overrides:
        assert metrics["compute_advantages/kl_coef"] == 0.0 and metrics["ppo_update/ref_kl"] > 0.0
    else:  # the replay starts from the coefficient its source started from
        assert metrics["compute_advantages/kl_coef"] == source_metrics["compute_advantages/kl_coef"]


def test_a_replay_the_experience_cannot_serve_is_refused_before_anything_runs(grouped):
    source = resolve_run(grouped, "grpo:1")
    tracker = tracking_store(grouped).tracker()
    client = MlflowClient(tracker.tracking_uri)
    runs_before = len(client.search_runs([tracker.experiment_id("grpo")], max_results=1000))
    with pytest.raises(ConfigError, match="needs critic values, but the source iteration rolled out without a critic"):
        rlhf_replay(replay_config(grouped, source, ["advantages.estimator=gae"]), source)
    assert len(client.search_runs([tracker.experiment_id("grpo")], max_results=1000)) == runs_before


@pytest.fixture(scope="module")
def function_reward(prefect_server, checkpoint_world, run_root):
    """REINFORCE++ with a reward function (one sample per prompt), one iteration."""
    overrides = [
        *_world(checkpoint_world, run_root),
        "campaign=verifiable",
        "iterations=1",
        "reward.source=function",
        "reward.function=tests.flows.rewards:length_score",
        "advantages.estimator=reinforce_pp",
    ]
    config = load_config(TINY, overrides)
    rlhf_campaign(config)
    return config


def test_a_reward_function_replaces_candidates_preferences_and_the_reward_model(function_reward):
    campaign_dir = function_reward.run_root / function_reward.campaign
    for skipped in ("sample_candidates", "collect_preferences", "train_reward_model"):
        assert not (campaign_dir / skipped).exists(), skipped
    tracker = tracking_store(function_reward).tracker()
    metrics = tracker.run(resolve_run(function_reward, "verifiable:0")).metrics
    (rollout,) = _outputs(function_reward, "rollout")
    table = pq.read_table(next(rollout.glob("experience-*.parquet")))
    lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
    assert metrics["rollout/score_mean"] > 0 and len(lengths) == 16
    # Evaluation scores with the function too, and (labeler gold) still reports the gold metrics.
    assert metrics["evaluate/reward_mean"] > 0 and 0.0 <= metrics["evaluate/gold_win_rate"] <= 1.0
    _, state = load_latest_state.fn(function_reward, resolve_base.fn(function_reward))
    assert state.reward_model is None and state.preferences == ()


def test_a_group_estimator_replay_of_a_rollout_without_groups_is_refused(function_reward):
    source = resolve_run(function_reward, "verifiable:0")
    with pytest.raises(ConfigError, match=r"needs groups.*`sizes.samples_per_prompt` 1"):
        replay_config(function_reward, source, ["advantages.estimator=rloo"])


def test_issue23_a_reward_function_returning_nan_is_refused_before_anything_runs(function_reward):
    broken = function_reward.model_copy(
        update={
            "campaign": "broken",
            "reward": function_reward.reward.model_copy(update={"function": "tests.flows.rewards:not_finite"}),
        }
    )
    with pytest.raises(
        RewardFunctionError, match=r"`reward.function` tests\.flows\.rewards:not_finite returned nan for prompt row 1 "
    ):
        rlhf_campaign(broken)
    assert not (broken.run_root / "broken").exists()


GROUP_ESTIMATORS = {
    "rloo": ["advantages.estimator=rloo"],
    "dr_grpo": ["advantages.estimator=dr_grpo", "ppo.aggregation=token_sum_norm"],
}


@pytest.fixture(scope="module")
def group_estimators(prefect_server, checkpoint_world, run_root):
    """One campaign with a reward function on groups of 2 (8 prompts x 2), one iteration under each estimator of
    :data:`GROUP_ESTIMATORS` in turn, each after the first recomputing iteration 0: ``{estimator: (config, metrics of
    its iteration run, its update's output)}``."""
    ran = {}
    for estimator, overrides in GROUP_ESTIMATORS.items():
        config = load_config(
            TINY,
            [
                *_world(checkpoint_world, run_root),
                "campaign=groups",
                "iterations=1",
                "sizes.samples_per_prompt=2",
                "sizes.rollout_prompts=8",
                "reward.source=function",
                "reward.function=tests.flows.rewards:length_score",
                *overrides,
            ],
        )
        rlhf_campaign(config, from_iteration=0 if ran else None)
        metrics = tracking_store(config).tracker().run(resolve_run(config, "groups:0")).metrics
        (update,) = set(_outputs(config, "ppo_update")) - {update for _, _, update in ran.values()}
        ran[estimator] = config, metrics, update
    assert len(_outputs(config, "rollout")) == 1, "the estimators' campaigns share their rollout"
    return ran


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_the_other_group_estimators_run_the_campaign_too(group_estimators, estimator):
    """GAE (test_rlhf_pipeline), GRPO and REINFORCE++ (above) run whole campaigns; so do RLOO and Dr. GRPO."""
    _, metrics, update = group_estimators[estimator]
    assert metrics["ppo_update/optimizer_steps"] == 2 and 0.0 <= metrics["evaluate/gold_win_rate"] <= 1.0
    assert not (update / "critic").exists()


def test_issue23_a_rubric_labels_the_pairs_a_reward_model_learns_from(grouped):
    """`labeler: function`: the rubric (`reward.function`) prefers the longer candidate, and evaluation reports it."""
    for preferences in _outputs(grouped, "collect_preferences"):
        pairs = pq.read_table(next(preferences.glob("preferences-*.parquet"))).to_pylist()
        assert len(pairs) == 16 and {pair["labeler"] for pair in pairs} == {"function"}
        for pair in pairs:  # the chosen response is never shorter, and the margin is the score gap
            chosen, rejected = len(pair["chosen"].split()), len(pair["rejected"].split())
            assert chosen >= rejected and pair["margin"] == pytest.approx(0.1 * (chosen - rejected), abs=1e-6)
    metrics = tracking_store(grouped).tracker().run(resolve_run(grouped, "grpo:0")).metrics
    assert metrics["evaluate/rubric_mean"] >= 0 and metrics["evaluate/reference_rubric_mean"] >= 0
