"""Episodes through the pipeline (issue 44): tiny campaigns whose rollouts play the scripted environments of
tests/environments.py, turn by turn, on a tiny chat policy (ChatML, hf engine); what they store, how stage 5 scores
it, failures as rows, and a replay under another estimator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.config import ConfigError, load_config
from campaign.identity import base_inputs
from campaign.store import resolve_run
from flows.inspection import inspect_campaign, render_table
from flows.iterations import tracking_store
from flows.replay import replay_config
from flows.rlhf_pipeline import rlhf_campaign, rlhf_replay
from runtime.references import EnvironmentClassError
from storage.manifest import read_manifest
from storage.shards import read_table
from tasks.sft_text import turn_delta
from tasks.text import load_tokenizer
from tests.environments import Guess
from tests.flows.conftest import episode_overrides

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _config(world: dict[str, Path], run_root: Path, *overrides: str):
    return load_config(TINY, episode_overrides(world, run_root, *overrides))


@pytest.fixture(scope="module")
def grpo(prefect_server, episode_world, tmp_path_factory):
    """Two iterations of GRPO on :class:`tests.environments.Guess`."""
    config = _config(
        episode_world,
        tmp_path_factory.mktemp("episodes-grpo"),
        "campaign=episodes-grpo",
        "iterations=2",
        "environment.class=tests.environments:Guess",
        "advantages.estimator=grpo",
    )
    rlhf_campaign(config)
    return config


@pytest.fixture(scope="module")
def gae(prefect_server, episode_world, tmp_path_factory):
    """One iteration of GAE (a critic) on :class:`tests.environments.Faulty`, two of whose prompts fail."""
    config = _config(
        episode_world,
        tmp_path_factory.mktemp("episodes-gae"),
        "campaign=episodes-gae",
        "iterations=1",
        "environment.class=tests.environments:Faulty",
        "advantages.estimator=gae",
    )
    rlhf_campaign(config)
    return config


def _outputs(config, stage: str) -> list[Path]:
    return sorted((config.run_root / config.campaign / stage).iterdir())


def _rows(config, stage: str, table: str, index: int = 0) -> list[dict]:
    return read_table(_outputs(config, stage)[index], table).to_pylist()


def _episodes(config, index: int = 0, *, folder: Path | None = None) -> list[tuple[dict, list[dict]]]:
    """Each experience row of a rollout output (``folder``, or the ``index``-th) with its turns, in order."""
    folder = folder or _outputs(config, "rollout")[index]
    turns = read_table(folder, "turns").to_pylist()
    return [
        (row, [turn for turn in turns if turn["row"] == row["row"]])
        for row in read_table(folder, "experience").to_pylist()
    ]


def _output_of(config, iteration: int, stage: str) -> Path:
    """The output of ``stage`` that the campaign's iteration ``iteration`` recorded."""
    tracker = tracking_store(config).tracker()
    run = tracker.run(resolve_run(config, f"{config.campaign}:{iteration}"))
    return Path(tracker.run(run.tags[f"rlhf.output.{stage}"]).tags["rlhf.output_path"])


@pytest.mark.parametrize("campaign", ["grpo", "gae"])
def test_the_model_mask_has_gaps_exactly_at_the_environments_tokens_and_the_turns_cover_the_window(campaign, request):
    config = request.getfixturevalue(campaign)
    gaps = 0
    for row, turns in _episodes(config):
        covered = [(turn["token_start"], turn["token_stop"]) for turn in turns]
        assert [start for start, _ in covered] == [0, *(stop for _, stop in covered)][: len(covered)]  # contiguous
        assert (covered[-1][1] if covered else 0) == len(row["response_ids"])
        failed = turns and turns[-1]["stop_reason"] not in ("done", "max_turns")
        expected = [turn["role"] == "assistant" and not failed for turn in turns for _ in range(*_span(turn))]
        assert row["action_mask"] == expected
        gaps += sum(turn["role"] == "user" for turn in turns)
        assert sum(row["turn_rewards"]) == pytest.approx(row["scores"])
        assert sum(turn["turn_reward"] or 0.0 for turn in turns) == pytest.approx(row["scores"])
        assert all(turn["turn_reward"] is None for turn in turns if turn["role"] == "user")
    assert gaps > 0  # some episode had more than one turn


def _span(turn: dict) -> tuple[int, int]:
    return turn["token_start"], turn["token_stop"]


def test_the_environments_tokens_are_the_template_delta_of_its_replies(grpo, episode_world):
    """Replay each episode against a fresh Guess (deterministic, from the stored seed): every environment segment's
    ids are the chat template's delta for its reply, the newline after `<|im_end|>` included."""
    tokenizer = load_tokenizer(str(episode_world["policy"]))
    rows = {
        index: row
        for index, row in enumerate(json.loads(line) for line in episode_world["prompts"].read_text().splitlines())
    }
    checked = 0
    for row, turns in _episodes(grpo):
        environment = Guess()
        prompt = rows[row["prompt_id"]]
        messages = [{"role": "user", "content": environment.reset(seed=turns[0]["environment_seed"], row=prompt)}]
        for turn in turns:
            ids = row["response_ids"][slice(*_span(turn))]
            if turn["role"] == "assistant":
                text = tokenizer.decode(ids, skip_special_tokens=True)
                ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
                messages.append({"role": "assistant", "content": text})
                observation, reward, done = environment.step(text)
                assert reward == pytest.approx(turn["turn_reward"]) and done == (turn["stop_reason"] == "done")
                continue
            messages.append({"role": "user", "content": observation})
            assert ids == turn_delta(tokenizer, messages, ended=ended)
            bridge = "\n<|im_start|>user\n" if ended else "<|im_end|>\n<|im_start|>user\n"
            assert tokenizer.decode(ids).startswith(bridge) and tokenizer.decode(ids).endswith(
                "<|im_start|>assistant\n"
            )
            checked += 1
    assert checked > 0


def test_advantages_are_zero_at_the_environments_tokens(grpo, gae):
    for config in (grpo, gae):
        for row in _rows(config, "compute_advantages", "scored_experience"):
            for name in ("advantages", "returns", "kl", "rewards"):
                assert all(v == 0.0 for v, action in zip(row[name], row["action_mask"], strict=True) if not action)
    values = [v for row in _rows(gae, "compute_advantages", "scored_experience") for v in row["advantages"]]
    assert any(v != 0.0 for v in values)  # GAE with a critic: the model's tokens carry advantages


def test_a_failing_environment_gives_error_rows_counted_and_the_stage_finishes(gae):
    episodes = _episodes(gae)
    failed = [(row, turns) for row, turns in episodes if turns and turns[-1]["stop_reason"].startswith("error")]
    # Its reset broke the contract: no turn at all, its one segment the environment's, empty, with the stop reason.
    reset_failures = [row for row, turns in failed if turns[0]["token_stop"] == 0]
    assert len(reset_failures) == 2 and all(row["response_ids"] == [] for row in reset_failures)
    assert len(failed) >= 3 and all(not any(row["action_mask"]) for row, _ in failed)
    manifest = read_manifest(_outputs(gae, "rollout")[0])
    assert manifest.metrics["episode_errors"] == len(failed)
    assert "retokenization_drift" in manifest.metrics
    tracker = tracking_store(gae).tracker()
    run = resolve_run(gae, f"{gae.campaign}:0")
    assert tracker.run(run).metrics["rollout/episode_errors"] == len(failed)
    assert _outputs(gae, "ppo_update")  # the update ran on the rest


def test_a_replay_under_another_estimator_samples_nothing(grpo):
    source = resolve_run(grpo, f"{grpo.campaign}:0")
    rollouts_before = _outputs(grpo, "rollout")
    replay = replay_config(grpo, source, ["advantages.estimator=rloo"])
    replay_run = rlhf_replay(replay, source)
    assert _outputs(grpo, "rollout") == rollouts_before
    metrics = tracking_store(grpo).tracker().run(replay_run).metrics
    assert "compute_advantages/advantage_mean" in metrics and "ppo_update/optimizer_steps" in metrics


def test_episodes_are_refused_in_one_line_where_they_do_not_apply(episode_world, tmp_path):
    run_root = tmp_path / "runs"
    with pytest.raises(ConfigError, match="`reward.source` environment needs `environment.class`"):
        _config(episode_world, run_root)
    with pytest.raises(ConfigError, match="labelling episodes for a reward model is out of scope"):
        _config(episode_world, run_root, "environment.class=tests.environments:Guess", "labeler=gold", "demo=true")
    engine = _config(episode_world, run_root, "environment.class=tests.environments:Guess", "sampling.engine=vllm")
    assert (
        engine.episodes and engine.sampling.engine == "vllm"
    )  # episodes on the engine: tests/flows/test_vllm_episodes.py
    with pytest.raises(EnvironmentClassError, match=r"^`environment.class` 'tests.environments:NoStep' has no method"):
        base_inputs(_config(episode_world, run_root, "environment.class=tests.environments:NoStep"), None, None)


def _success_by_turn(turn_rewards: list[list[float]], turns: int) -> list[float]:
    """Share of episodes that had a turn with a reward > 0 among their first 1, 2, ... ``turns`` turns."""
    return [sum(any(r > 0 for r in rewards[:n]) for rewards in turn_rewards) / len(turn_rewards) for n in range(1, turns + 1)]  # fmt: skip


def test_held_out_episodes_of_the_policy_and_of_the_reference_played_once_are_evaluated(grpo, gae):
    """Every iteration evaluates the policy's held-out episodes against the reference's, played once per campaign from
    the same environment seeds: rewards, success by turn, recovery, turns and stop reasons, in MLflow and in the
    iteration's Prefect artifact, each figure what the samples it wrote say."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    for config, iterations in ((grpo, 2), (gae, 1)):
        (reference,) = _outputs(config, "sample_reference")  # one for the campaign, read by each evaluation
        played = read_table(reference, "reference_episodes").to_pylist()
        assert [row["row"] for row in played] == list(range(4))
        tracker = tracking_store(config).tracker()
        for iteration in range(iterations):
            metrics = tracker.run(resolve_run(config, f"{config.campaign}:{iteration}")).metrics
            evaluation = _output_of(config, iteration, "evaluate") / "samples.jsonl"
            samples = [json.loads(line) for line in evaluation.read_text().splitlines()]
            assert [s["reference_turn_rewards"] for s in samples] == [row["turn_rewards"] for row in played]
            assert [s["reference_stop_reason"] for s in samples] == [row["stop_reason"] for row in played]
            for side, prefix in (("policy", ""), ("reference", "reference_")):
                rewards = [s[f"{side}_turn_rewards"] for s in samples]
                assert all(s[f"{side}_reward"] == pytest.approx(sum(s[f"{side}_turn_rewards"])) for s in samples)
                assert metrics[f"evaluate/{prefix}reward_mean"] == pytest.approx(sum(map(sum, rewards)) / 4)
                by_turn = [metrics[f"evaluate/{prefix}success_by_turn_{n}"] for n in (1, 2, 3)]
                assert by_turn == pytest.approx(_success_by_turn(rewards, 3))
                assert metrics[f"evaluate/{prefix}success"] == by_turn[-1]
                assert metrics[f"evaluate/{prefix}turns_mean"] == pytest.approx(sum(map(len, rewards)) / 4)
                failed_first = [r for r in rewards if r and r[0] <= 0]
                if failed_first:
                    recovered = sum(any(v > 0 for v in r[1:]) for r in failed_first) / len(failed_first)
                    assert metrics[f"evaluate/{prefix}recovery"] == pytest.approx(recovered)
                stops = [metrics[f"evaluate/{prefix}stop_{reason}"] for reason in ("done", "max_turns", "error")]
                assert sum(stops) == pytest.approx(1.0) and metrics[f"evaluate/{prefix}stop_timeout"] == 0.0
            assert metrics["evaluate/kl_to_reference"] == pytest.approx(sum(s["policy_kl"] for s in samples) / 4)
    # Faulty (the last campaign): the prompt whose reset breaks the contract fails on both sides, with no turn.
    assert samples[3]["policy_turn_rewards"] == samples[3]["reference_turn_rewards"] == []
    assert samples[3]["policy_kl"] == 0.0 and samples[3]["reference_stop_reason"].startswith("error: TypeError")
    with get_client(sync_client=True) as client:
        key = f"{grpo.campaign}-iteration-1"
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1)
    assert (
        "| evaluate/reference_success_by_turn_2 |" in artifact.data and "| evaluate/stop_max_turns |" in artifact.data
    )


def test_inspect_counts_the_models_tokens_and_shows_an_episode_turn_by_turn(grpo, episode_world):
    inspection = inspect_campaign(grpo, f"{grpo.campaign}:0", top=16)  # and its replay's, when it ran
    episodes = _episodes(grpo, folder=_output_of(grpo, 0, "rollout"))
    masks = {row["row"]: row["action_mask"] for row, _ in episodes}
    shown = [row for row in inspection.responses.iter_rows(named=True) if row["run"] == "iteration"]
    assert {row["row"]: row["length"] for row in shown} == {
        row: sum(mask) for row, mask in masks.items()
    }  # the model's tokens, never the environment's
    assert inspection.summary["length_mean"][0] == pytest.approx(sum(map(sum, masks.values())) / len(masks))
    text = render_table(inspection)
    tokenizer = load_tokenizer(str(episode_world["policy"]))
    for row, turns in episodes:
        block = text.split(f"iteration 0, row {row['row']}, ")[1].split("\n\niteration ")[0].rstrip()
        expected = [
            f"turn {turn['turn'] + 1}, model (reward {turn['turn_reward']:.4g}): "
            if turn["role"] == "assistant"
            else f"turn {turn['turn'] + 1}, environment: "
            + json.dumps(tokenizer.decode(row["response_ids"][slice(*_span(turn))]), ensure_ascii=False)
            for turn in turns
            if turn["role"] == "assistant" or turn["token_stop"] > turn["token_start"]
        ]
        shown = [line.strip() for line in block.splitlines() if line.strip().startswith("turn ")]
        assert [line[: len(start)] for line, start in zip(shown, expected, strict=True)] == expected
        assert block.splitlines()[-1].strip() == f"stopped: {turns[-1]['stop_reason']}"
    assert "<|im_end|>\\n<|im_start|>user\\n" in text  # the template's delta as it was trained on
