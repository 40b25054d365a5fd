"""Replay and compare: re-run stages 5-7 of a recorded iteration with new settings, no generation,
logged as a new MLflow run tagged with its source; and a side-by-side table of runs."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from campaign.config import ConfigError, PipelineConfig
from campaign.store import resolve_run
from flows.cli import main
from flows.iterations import tracking_store
from flows.replay import replay_config
from flows.report import compare_report
from flows.rlhf_pipeline import rlhf_campaign, rlhf_replay
from tests.flows.campaigns import copy_campaign, tiny_config


@pytest.fixture(scope="module")
def recorded(prefect_server, two_iteration_campaign, checkpoint_world, tmp_path_factory):
    """A copy of the shared two-iteration campaign: the replays below add runs and outputs to it."""
    run_root = copy_campaign(two_iteration_campaign.run_root, tmp_path_factory.mktemp("replay") / "runs")
    return tiny_config(run_root, checkpoint_world)


def test_replay_reruns_stages_5_to_7_only_and_is_tagged_with_its_source(recorded):
    source = resolve_run(recorded, f"{recorded.campaign}:1")
    replay = replay_config(recorded, source, ["advantages.kl_coef=0.5", "advantages.kl_estimator=k3", "ppo.epochs=2"])
    assert replay.advantages.kl_coef == 0.5 and replay.sampling == recorded.sampling
    campaign_dir = recorded.run_root / recorded.campaign
    rollouts_before = sorted(p.name for p in (campaign_dir / "rollout").iterdir())
    candidates_before = sorted(p.name for p in (campaign_dir / "sample_candidates").iterdir())

    replay_run = rlhf_replay(replay, source)

    tracker = tracking_store(recorded).tracker()
    client = MlflowClient(tracker.tracking_uri)
    tags = tracker.run(replay_run).tags
    assert tags["rlhf.kind"] == "replay" and tags["rlhf.replay_of"] == source and tags["rlhf.iteration"] == "1"
    children = client.search_runs(
        [tracker.experiment_id(recorded.campaign)], f"tags.`mlflow.parentRunId` = '{replay_run}'"
    )
    assert sorted(run.data.tags["rlhf.stage"] for run in children) == ["compute_advantages", "evaluate", "ppo_update"]
    # No generation: no new rollout or candidate outputs appeared.
    assert sorted(p.name for p in (campaign_dir / "rollout").iterdir()) == rollouts_before
    assert sorted(p.name for p in (campaign_dir / "sample_candidates").iterdir()) == candidates_before
    metrics = tracker.run(replay_run).metrics
    source_metrics = tracker.run(source).metrics
    assert metrics["ppo_update/optimizer_steps"] == 2 * source_metrics["ppo_update/optimizer_steps"]
    assert metrics["compute_advantages/kl_mean"] != source_metrics["compute_advantages/kl_mean"]
    # A replay is an experiment: it does not move the registered models' newest version.
    assert int(client.get_model_version_by_alias(f"{recorded.campaign}-actor", "latest").version) == 2

    table = compare_report(
        recorded, [source, replay_run], metrics=["compute_advantages/kl_mean", "evaluate/gold_win_rate"]
    )
    assert "replay" in table and "compute_advantages/kl_mean" in table


def test_replay_refuses_settings_that_need_new_rollouts(recorded):
    source = resolve_run(recorded, f"{recorded.campaign}:0")
    with pytest.raises(ConfigError, match="sampling.temperature"):
        replay_config(recorded, source, ["sampling.temperature=0.5"])


def test_a_replay_started_outside_the_command_line_is_checked_too(recorded):
    source = resolve_run(recorded, f"{recorded.campaign}:0")
    changed = recorded.model_copy(update={"seed": 99})
    with pytest.raises(ConfigError, match="`seed`"):
        rlhf_replay(changed, source)


def test_compare_command_prints_a_table_and_names_unknown_runs(recorded, capsys):
    location = [f"--set=run_root={recorded.run_root}"]
    assert (
        main(
            ["compare", f"{recorded.campaign}:0", recorded.campaign, "--metrics", "evaluate/kl_to_reference", *location]
        )
        == 0
    )
    output = capsys.readouterr().out
    assert "evaluate/kl_to_reference" in output and "iteration" in output
    assert main(["compare", "no-such-campaign:3", *location]) == 2
    assert "no-such-campaign" in capsys.readouterr().err


def test_an_iteration_run_whose_stages_were_all_reused_can_be_replayed_and_continued(recorded):
    """A setting outside every stage's key (here `human.poll_seconds`) makes new iteration runs whose
    stages are all reused from the first campaign's runs; they must still name their outputs."""
    from flows.iterations import load_latest_state, resolve_base

    again = recorded.model_copy(update={"human": recorded.human.model_copy(update={"poll_seconds": 5})})
    state = rlhf_campaign(again)
    assert state.policy.reused
    source = resolve_run(again, f"{again.campaign}:1")
    assert tracking_store(again).tracker().run(source).tags["rlhf.iteration_key"] != ""
    campaign_dir = again.run_root / again.campaign

    def outputs(stage: str) -> int:
        return len(list((campaign_dir / stage).glob("*/_manifest.json")))

    before = outputs("compute_advantages"), outputs("ppo_update")
    replay_run = rlhf_replay(replay_config(again, source, ["ppo.epochs=3"]), source)
    assert tracking_store(again).tracker().run(replay_run).tags["rlhf.replay_of"] == source
    # Two replays that differ only in an update setting: the update's key holds it (two new outputs, where a setting
    # left out of the key would have the second find the first's), the advantages' does not (found both times).
    rlhf_replay(replay_config(again, source, ["ppo.epochs=2"]), source)
    assert (outputs("compute_advantages"), outputs("ppo_update")) == (before[0], before[1] + 2)
    next_iteration, latest = load_latest_state.fn(again, resolve_base.fn(again))
    assert next_iteration == again.iterations and latest.policy.digest == state.policy.digest


def test_issue26_a_replay_reads_its_config_from_the_store_not_from_a_config_file(recorded, capfd):
    """`rlhf replay CAMPAIGN:N --set ...` as the README writes it: no --config, only where the store is. Its
    settings change the source run's recorded config (here its model and prompt files, which the defaults lack),
    and one the defaults could not take (a KL horizon below their rollouts' count) is judged against the source's."""
    command = ["replay", f"{recorded.campaign}:1", f"--set=run_root={recorded.run_root}"]
    settings = ["--set=advantages.kl_coef=0.1", "--set=advantages.kl_target=2", "--set=advantages.kl_horizon=16"]
    assert main([*command, *settings]) == 0
    output, errors = capfd.readouterr()
    assert "Downloading artifacts" not in errors  # issue 27: MLflow's progress bars only with --verbose
    replay_run = output.split("Replay run ")[1].split(";")[0]
    tracker = tracking_store(recorded).tracker()
    replayed = PipelineConfig.model_validate_json(tracker.load_text(replay_run, "config.json"))
    assert replayed.advantages.kl_coef == 0.1 and replayed.advantages.kl_horizon == 16
    assert replayed.model.policy == recorded.model.policy and replayed.data == recorded.data
