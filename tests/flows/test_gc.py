"""rlhf gc against a real campaign: what it removes, and that continuing, resuming a crashed iteration and
replaying a kept iteration all still work afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from campaign.gc import collect_garbage, plan_gc
from campaign.store import resolve_run
from flows.cli import main
from flows.iterations import load_latest_state, open_iteration, resolve_base, tracking_store
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_iteration, rlhf_replay
from tasks.collect_preferences import collect_preferences
from tasks.sample_candidates import sample_candidates
from tests.flows.campaigns import copy_campaign, tiny_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _outputs(config) -> set[str]:
    root = config.run_root / config.campaign
    return {f"{path.parent.parent.name}/{path.parent.name}" for path in root.glob("*/*/_manifest.json")}


@pytest.fixture(scope="module")
def collected(prefect_server, two_iteration_campaign, checkpoint_world, tmp_path_factory):
    """A 3-iteration campaign (a copy of the shared two-iteration one, continued), a pinned model version, a crashed
    4th iteration, then `rlhf gc --keep-last 1`."""
    run_root = copy_campaign(two_iteration_campaign.run_root, tmp_path_factory.mktemp("gc") / "runs")
    config = tiny_config(run_root, checkpoint_world, "iterations=3")
    rlhf_campaign(config)
    tracker = tracking_store(config).tracker()
    client = MlflowClient(tracker.tracking_uri)
    client.set_registered_model_alias(f"{config.campaign}-actor", "champion", "1")  # a person pins iteration 0's actor
    # A 4th iteration that crashed after two stages: its run stays RUNNING with two recorded outputs.
    base = resolve_base.fn(config)
    iteration, state = load_latest_state.fn(config, base)
    context = open_iteration.fn(config, iteration, base, state)
    candidates = sample_candidates.run(context, config, policy=state.policy, earlier=())
    collect_preferences.run(context, config, candidates=candidates, reward_model=None, labels=None, earlier=())
    before = _outputs(config)
    source_of_iteration_0 = resolve_run(config, f"{config.campaign}:0")
    assert main(["gc", config.campaign, "--dry-run", f"--set=run_root={config.run_root}"]) == 0
    assert _outputs(config) == before  # a dry run changes nothing
    plan = collect_garbage(config, keep_last=1)
    return config, before, plan, source_of_iteration_0


def test_gc_removes_old_outputs_and_unpinned_versions_and_keeps_what_is_needed(collected):
    config, before, plan, _ = collected
    after = _outputs(config)
    assert plan.remove and plan.bytes > 0 and after == before - {f"{f.parent.name}/{f.name}" for f, _ in plan.remove}
    stages_left = {name.split("/")[0] for name in after}
    assert {"ppo_update", "train_reward_model", "rollout", "evaluate", "sample_candidates"} <= stages_left
    # Iteration 0's reward model goes. Its actor is pinned (and the critic lives in the same folder),
    # and iteration 1's models are the inputs iteration 2 started from (a replay of iteration 2 needs them).
    assert plan.versions == [(f"{config.campaign}-reward-model", "1")]
    assert not plan_gc(config, keep_last=1).remove  # nothing more to remove


def test_after_gc_the_crashed_iteration_resumes_from_its_recorded_stages(collected):
    config, *_ = collected
    state = rlhf_iteration(config, return_state=True)
    assert state.is_completed(), state
    assert (
        tracking_store(config)
        .tracker()
        .latest_iteration(tracking_store(config).tracker().experiment_id(config.campaign))
        == 3
    )


def test_after_gc_a_kept_iteration_replays_and_a_removed_one_is_refused_clearly(collected):
    config, _, _, source_of_iteration_0 = collected
    source = resolve_run(config, f"{config.campaign}:2")
    replayed = rlhf_replay(replay_config(config, source, ["advantages.kl_coef=0.2"]), source)
    assert tracking_store(config).tracker().run(replayed).tags["rlhf.replay_of"] == source
    with pytest.raises(Exception, match="no longer exists"):
        rlhf_replay(replay_config(config, source_of_iteration_0, ["advantages.kl_coef=0.2"]), source_of_iteration_0)


def test_issue32_a_finished_campaign_run_again_after_gc_checks_what_is_left(collected, capsys):
    """The outputs gc removed are not missing ones: running the finished campaign again checks what is left (the
    newest iteration's outputs and what they were computed from, all there) and has nothing to run."""
    config, *_ = collected
    tracker = tracking_store(config).tracker()
    finished = tracker.finished_iterations(tracker.experiment_id(config.campaign))
    overrides = [
        f"run_root={config.run_root}",
        f"model.policy={config.model.policy}",
        f"data.prompts={config.data.prompts}",
        f"data.eval_prompts={config.data.eval_prompts}",
        f"iterations={len(finished)}",
    ]
    capsys.readouterr()
    assert main(["run", "--config", str(TINY), *(f"--set={text}" for text in overrides)]) == 0
    said = capsys.readouterr().out
    assert f"all {len(finished)} iterations are finished; nothing to run" in said and "restored" not in said
