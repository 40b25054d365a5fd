"""Issue 33: one-step off-policy iterations (``sampling.staleness`` 1) end to end, on the tiny campaign under a real
Prefect server and a real SQLite MLflow store.

A campaign runs each next iteration's generation stages beside the current update (flows.overlap); the same iterations
run one at a time write the same outputs, every rollout names the policy that sampled it, every row its version, the
updates correct for it, MLflow shows the lineage, and a replay works on the overlapped experience.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from campaign.store import resolve_run
from flows.iterations import finished_state, resolve_base, tracking_store
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_iteration, rlhf_replay
from rlhf_core.episodes import episode_gae
from rlhf_core.models import Critic
from rlhf_core.sequences import response_slice
from runtime.declaration import StageResult
from storage.experience_io import table_to_experience, with_values
from storage.manifest import read_manifest
from storage.schemas import SCORES
from storage.shards import read_table
from tasks.rollout import ROLLOUT_PROMPT_OFFSET
from tasks.staleness import policy_version
from tasks.text import read_prompts, rotating_subset
from tests.flows.campaigns import tiny_config

ITERATIONS = 3


OVERLAPPED = ("sampling.staleness=1", "model.critic_init=reward_model", "advantages.score_statistics=running")
"""Issue 43: the critic starts from the first reward model, and the scores are normalised by running moments, the two
settings whose state crosses iterations."""


def _config(run_root: Path, world: dict[str, Path], *more: str):
    return tiny_config(run_root, world, f"iterations={ITERATIONS}", *OVERLAPPED, *more)


@pytest.fixture(scope="module")
def overlapped(prefect_server, checkpoint_world, tmp_path_factory):
    config = _config(tmp_path_factory.mktemp("overlapped"), checkpoint_world)
    return config, rlhf_campaign(config)


def _outputs(config) -> dict[str, StageResult]:
    """``stage/iteration -> StageResult`` of every finished stage output of the campaign, from the manifests."""
    outputs = {}
    for path in (config.run_root / config.campaign).glob("*/*/_manifest.json"):
        manifest = read_manifest(path.parent, verify=True)
        iteration = manifest.config["context"]["iteration"]
        result = StageResult.of(path.parent, manifest, reused=True, run_id=None)
        outputs[f"{manifest.stage}/{iteration}"] = result
    return outputs


def _hashes(config) -> dict[str, str]:
    """``stage/key/file -> sha256`` of every finished stage output."""
    return {
        f"{path.parent.relative_to(config.run_root / config.campaign)}/{entry.path}": entry.sha256
        for path in (config.run_root / config.campaign).glob("*/*/_manifest.json")
        for entry in read_manifest(path.parent, verify=True).files
    }


def test_issue33_each_rollout_samples_the_policy_one_version_behind_its_update_and_every_row_says_so(overlapped):
    config, _ = overlapped
    outputs = _outputs(config)
    for iteration in range(ITERATIONS):
        rollout, update = outputs[f"rollout/{iteration}"], outputs[f"ppo_update/{iteration}"]
        behind = max(0, iteration - 1)
        sampler = outputs["initialize/0"] if behind == 0 else outputs[f"ppo_update/{behind - 1}"]
        # The rollout's key names the policy that sampled it; the update starts from the newest one.
        assert read_manifest(rollout.directory).upstream["policy"] == sampler.digest
        starting = outputs["initialize/0"] if iteration == 0 else outputs[f"ppo_update/{iteration - 1}"]
        assert read_manifest(update.directory).upstream["policy"] == starting.digest
        # Staleness is a query: the update's version less each row's.
        versions = read_table(rollout.directory, "experience").column("policy_version").to_pylist()
        assert set(versions) == {policy_version(sampler)} == {behind}
        assert policy_version(starting) - behind == (1 if iteration else 0)
        assert update.metrics["staleness_max"] == (1.0 if iteration else 0.0)
        assert update.metrics["stale_fraction"] == (1.0 if iteration else 0.0)
        # Decoupled PPO weighed the stale rows (pi_prox / pi_behaviour, capped at 2).
        if iteration:
            assert update.metrics["behaviour_weight_mean"] != 1.0
            assert 0 < update.metrics["behaviour_weight_mean"] <= 2.0


def test_issue43_the_initial_policys_rollouts_take_their_values_from_the_critic_the_first_update_trains(overlapped):
    """Iteration 1 still samples the initial policy, beside iteration 0's update: its values come from the critic
    that update trains (started from iteration 0's reward model), not from one started from iteration 1's reward
    model that no update trains; once a rollout samples a trained policy, it uses that policy's critic."""
    config, _ = overlapped
    outputs = _outputs(config)
    first = outputs["train_reward_model/0"].digest
    for name in ("rollout/0", "ppo_update/0", "rollout/1"):
        assert read_manifest(outputs[name].directory).upstream["critic_start"] == first, name
    for name in ("ppo_update/1", "rollout/2", "ppo_update/2"):
        assert "critic_start" not in read_manifest(outputs[name].directory).upstream, name


def _experience(directory: Path, table: str = "experience", values: Path | None = None):
    rows = read_table(directory, table)
    return table_to_experience(
        rows if values is None else with_values(rows, read_table(values, "critic_values")), pad_token_id=0
    )


def test_issue42_an_overlapped_update_computes_its_advantages_with_the_values_of_the_critic_it_starts_from(
    overlapped, two_iteration_campaign
):
    """From iteration 1 on the rollout scored its rows with the older sampled policy's critic: the ``critic_values``
    stage values them with the critic the update starts from (its output is that critic's forward of the rows), stage
    5 computes GAE with those values and hands them to the update's value clip, and records how far the rollout's
    critic was. Iteration 0 (the rollout's critic is the update's) and a sequential campaign have no such stage."""
    config, _ = overlapped
    outputs = _outputs(config)
    assert "critic_values/0" not in outputs
    assert "critic_values" not in read_manifest(outputs["compute_advantages/0"].directory).upstream
    for iteration in range(1, ITERATIONS):
        values, rollout = outputs[f"critic_values/{iteration}"], outputs[f"rollout/{iteration}"]
        starting, scored = outputs[f"ppo_update/{iteration - 1}"], outputs[f"compute_advantages/{iteration}"]
        upstream = read_manifest(values.directory).upstream
        assert (upstream["experience"], upstream["policy"]) == (rollout.digest, starting.digest)
        assert read_manifest(scored.directory).upstream["critic_values"] == values.digest
        # The starting critic's forward of the rollout's rows: its output just before each action token.
        experience = _experience(rollout.directory)
        critic = Critic.from_pretrained(starting.directory / "critic", require_head=True).eval()
        with torch.no_grad():
            direct = response_slice(critic(experience.sequences, experience.attention_mask), experience.prompt_length)
        recomputed = _experience(rollout.directory, values=values.directory).old_values
        mask = experience.action_mask
        torch.testing.assert_close(recomputed, torch.where(mask, direct, 0.0), rtol=0.0, atol=1e-5)
        # Stage 5's advantages are GAE over its rewards and those values, which its output carries to the update.
        graded = _experience(scored.directory, "scored_experience")
        assert torch.equal(graded.old_values, recomputed) and not torch.equal(recomputed, experience.old_values)
        advantages = config.advantages
        gae = episode_gae(graded.rewards, recomputed, mask, gamma=advantages.gamma, gae_lambda=advantages.gae_lambda)
        torch.testing.assert_close(graded.advantages, gae.advantages, rtol=0.0, atol=1e-6)
        shift = (recomputed - experience.old_values).abs()[mask].mean().item()
        assert values.metrics["value_shift_mean"] == pytest.approx(shift, rel=1e-5) and shift > 0
    sequential = _outputs(two_iteration_campaign)
    assert "compute_advantages/1" in sequential and not any(name.startswith("critic_values") for name in sequential)


def test_issue43_running_score_moments_start_again_with_each_retrained_reward_model(overlapped):
    """Each iteration retrains the reward model, whose scores have a scale of their own: the running moments of an
    iteration are those of its own rollout's scores, not pooled with an earlier reward model's."""
    config, _ = overlapped
    outputs = _outputs(config)
    for iteration in range(ITERATIONS):
        scores = read_table(outputs[f"rollout/{iteration}"].directory, "experience").column(SCORES).to_pylist()
        metrics = outputs[f"compute_advantages/{iteration}"].metrics
        assert metrics["score_count"] == len(scores)
        assert metrics["score_running_mean"] == pytest.approx(sum(scores) / len(scores))


def test_issue33_no_prompt_is_skipped_or_sampled_twice(overlapped):
    config, _ = overlapped
    outputs = _outputs(config)
    prompts = read_prompts(config.data.prompts)
    for iteration in range(ITERATIONS):
        ids = read_table(outputs[f"rollout/{iteration}"].directory, "experience").column("prompt_id").to_pylist()
        chosen = rotating_subset(
            prompts, count=config.sizes.rollout_prompts, iteration=iteration, offset=ROLLOUT_PROMPT_OFFSET
        )
        assert sorted(ids) == sorted(index for index, _ in chosen for _ in range(config.sizes.samples_per_prompt))


def test_issue33_the_same_iterations_run_one_at_a_time_write_the_same_outputs(overlapped, tmp_path, checkpoint_world):
    """What is sampled does not depend on when it ran (flows.overlap, choice 1): iterations run alone, each after the
    previous one ended, write byte for byte what the overlapped campaign wrote."""
    config, _ = overlapped
    alone = _config(tmp_path, checkpoint_world)
    base, state = resolve_base(alone), None
    for iteration in range(ITERATIONS):
        state = rlhf_iteration(alone, iteration, state, base=base)
    assert _hashes(alone) == _hashes(config)


def test_issue33_mlflow_records_each_output_under_its_own_iteration_with_its_lineage(overlapped):
    config, _ = overlapped
    client = MlflowClient(tracking_uri=f"sqlite:///{config.run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(config.campaign)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    assert {run.info.status for run in runs} == {"FINISHED"}
    parents = {run.info.run_id: run for run in runs if run.data.tags.get("rlhf.kind") == "iteration"}
    stage_runs = [run for run in runs if run.data.tags.get("rlhf.kind") == "stage"]
    keys = [(run.data.tags["rlhf.stage"], run.data.tags["rlhf.input_key"]) for run in stage_runs]
    assert len(keys) == len(set(keys)), "each output is recorded once, though the next iteration's ran ahead"
    outputs = _outputs(config)
    for run in stage_runs:
        parent = parents[run.data.tags["mlflow.parentRunId"]]
        assert run.data.tags["rlhf.iteration"] == parent.data.tags["rlhf.iteration"]
    for iteration in range(ITERATIONS):
        (rollout,) = [
            run
            for run in stage_runs
            if run.data.tags["rlhf.stage"] == "rollout" and run.data.tags["rlhf.iteration"] == str(iteration)
        ]
        policy = read_manifest(outputs[f"rollout/{iteration}"].directory).upstream["policy"]
        assert rollout.data.tags["rlhf.upstream.policy"] == policy
        (maker,) = [run for run in stage_runs if run.data.tags["rlhf.manifest_digest"] == policy]
        assert maker.data.tags["rlhf.stage"] == ("initialize" if iteration < 2 else "ppo_update")
        assert rollout.data.metrics["rollout/policy_version"] == max(0, iteration - 1)


def test_issue33_a_campaign_continued_from_mlflow_samples_from_the_same_policy(overlapped):
    config, final = overlapped
    runs = (
        tracking_store(config)
        .tracker()
        .finished_iterations(tracking_store(config).tracker().experiment_id(config.campaign))
    )
    rebuilt = finished_state(config, resolve_base(config), runs[ITERATIONS - 1])
    assert rebuilt.policy.digest == final.policy.digest
    assert [policy.digest for policy in rebuilt.earlier] == [policy.digest for policy in final.earlier]
    assert rebuilt.sampler(1).digest == final.sampler(1).digest != final.policy.digest


def _replayed_output(tracker, campaign: str, replay_run: str, stage: str) -> Path:
    """The output folder of the replay ``replay_run``'s ``stage``."""
    (run,) = [
        run for run in tracker.runs(tracker.experiment_id(campaign), tags={"rlhf.stage": stage})
        if run.tags.get("mlflow.parentRunId") == replay_run
    ]  # fmt: skip
    return Path(run.tags["rlhf.output_path"])


def test_issue33_a_replay_of_an_overlapped_iteration_can_take_either_correction(overlapped):
    """Either correction; and (issue 42) a replay's stage 5 reads the starting critic's values back: it runs no
    critic, even where it computes the advantages again with another ``gae_lambda``."""
    config, _ = overlapped
    source = resolve_run(config, f"{config.campaign}:2")
    tracker = tracking_store(config).tracker()
    values = _outputs(config)["critic_values/2"]
    replays = (
        (["ppo.off_policy=behaviour"], False),
        (["ppo.behaviour_weight_cap=1.5", "advantages.gae_lambda=0.9"], True),
    )
    for settings, weighed in replays:
        replay_run = rlhf_replay(replay_config(config, source, settings), source)
        assert tracker.run(replay_run).tags["rlhf.replay_of"] == source
        output = partial(_replayed_output, tracker, config.campaign, replay_run)
        metrics = json.loads((output("ppo_update") / "_manifest.json").read_text())["metrics"]
        assert metrics["staleness_max"] == 1.0
        assert (metrics["behaviour_weight_mean"] != 1.0) == weighed
    scored = output(
        "compute_advantages"
    )  # the second replay's, with another gae_lambda (the first reused the source's)
    assert read_manifest(scored).upstream["critic_values"] == values.digest
    assert len(list((config.run_root / config.campaign / "critic_values").glob("*/_manifest.json"))) == ITERATIONS - 1
