"""Issue 44 on the vLLM engine: episodes sampled turn by turn by the engine (``sampling.engine: vllm``), each turn
given the episode's ids so far, never text.

A tiny episode campaign (tests/environments.py's ``Guess``, the episode settings of tests/flows/conftest.py) runs 2
iterations of GRPO through the ``rlhf`` command, which starts and stops the engine; then:

* every rollout's turns table is well formed (its segments cover each episode's window, the model's and the
  environment's in turn, one ending), its action mask is exactly the model's turns, whose tokens are the engine's
  (their log-probs the engine's, within 1e-4 of the trainer's fp32 forward), and ``rollout/retokenization_drift`` is 0;
* the probe gate proved the swaps of every stage that samples (the rollout's, the reference's and evaluation's held-out
  episodes), iteration 1's rollout the PPO update's weights;
* the same campaign's first rollout on ``hf`` has the same shape: the same episodes (rows, prompts, first messages'
  ids, environment seeds), the same tables, other tokens.

The policy answers in digits and its end of turn only (:func:`digit_policy`): a random model's odd token splits
would make the drift metric count them (15 of 16 episodes), not the engine path.

Needs the engine's environment (``bash scripts/setup-vllm.sh``): ``pytest -m vllm tests/flows/test_vllm_episodes.py``,
in CI's vllm step.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.engine import engine_python
from storage.shards import read_table
from tasks.text import load_tokenizer
from tests.flows.conftest import episode_overrides, write_episode_world
from tests.flows.test_crash import _run_to_end
from tests.flows.test_vllm_engine import _metrics, _outputs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not engine_python().exists(), reason="no engine environment: bash scripts/setup-vllm.sh"),
]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
MAX_TURNS, MAX_TOKENS_PER_TURN = 3, 6  # episode_overrides'


@pytest.fixture(scope="module")
def digit_world(tmp_path_factory) -> dict[str, Path]:
    """The episode world with a policy vLLM's CPU build serves (head size 64), which answers in digits 1-4 and its end
    of turn only (:func:`digit_policy`)."""
    world = write_episode_world(tmp_path_factory.mktemp("vllm-episode-world"), hidden=128)
    digit_policy(world["policy"])
    return world


def digit_policy(folder: Path) -> None:
    """Make the policy in ``folder`` answer with the tokens ``1``-``4`` and its end of turn only, about half its mass on
    the end of turn: every embedding gets a constant 1.0 in dimension 0, which dominates the last hidden state after
    its norm (about sqrt(H) there), and the output layer reads that dimension for these tokens only. Its replies
    ("3", "41", "") are text the template renders back to the same ids, and Guess answers them (a right number ends
    the episode)."""
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    digits = [tokenizer.convert_tokens_to_ids(digit) for digit in "1234"]
    width = model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[digits, 0] = 2.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 2.0 + math.log(len(digits)) / math.sqrt(width)
    model.save_pretrained(folder)


def _command(run_root: Path, world: dict[str, Path], *extra: str) -> list[str]:
    sets = episode_overrides(
        world,
        run_root,
        "environment.class=tests.environments:Guess",
        "advantages.estimator=grpo",
        "execution.engine_compile=false",
        *extra,
    )
    return [sys.executable, "-m", "flows", "run", "--config", str(TINY), *(f"--set={item}" for item in sets)]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "_manifest.json").read_text())


@pytest.fixture(scope="module")
def engine_run(digit_world, tmp_path_factory) -> Path:
    run_root = tmp_path_factory.mktemp("vllm-episodes")
    _run_to_end(_command(run_root, digit_world, "iterations=2", "sampling.engine=vllm"), run_root / "run.log")
    return run_root


def _episodes(folder: Path) -> list[tuple[dict, list[dict]]]:
    """Each experience row of a rollout output with its turns, in window order."""
    turns = read_table(folder, "turns").to_pylist()
    return [
        (row, sorted((turn for turn in turns if turn["row"] == row["row"]), key=lambda turn: turn["token_start"]))
        for row in read_table(folder, "experience").to_pylist()
    ]


def test_episodes_on_the_engine_keep_its_tokens_turn_by_turn_with_no_drift(engine_run, digit_world):
    tokenizer = load_tokenizer(digit_world["policy"])
    allowed = {tokenizer.convert_tokens_to_ids(digit) for digit in "1234"} | {tokenizer.eos_token_id}
    rollouts = _outputs(engine_run, "rollout")
    assert [iteration for iteration, _ in rollouts] == [0, 1]
    for _, folder in rollouts:
        metrics = _metrics(folder)
        assert metrics["retokenization_drift"] == 0.0 and metrics["episode_errors"] == 0.0, metrics
        assert metrics["engine_logprob_max_abs_diff"] < 1e-4 and metrics["engine_probe_gap"] < 1e-4, metrics
        episodes = _episodes(folder)
        assert len(episodes) == 8  # 4 prompts x 2 episodes
        for row, turns in episodes:
            window = len(row["response_ids"])
            # The turns table: its segments cover the window, the model's turns and the environment's replies in turn,
            # numbered by the model's turn, the last one ending the episode.
            assert [turn["token_start"] for turn in turns] == [0] + [turn["token_stop"] for turn in turns[:-1]]
            assert turns[-1]["token_stop"] == window
            roles = [turn["role"] for turn in turns]
            assert roles == ["assistant", "user"] * (len(turns) // 2) + ["assistant"] * (len(turns) % 2), roles
            model_turns = [turn for turn in turns if turn["role"] == "assistant"]
            assert 1 <= len(model_turns) <= MAX_TURNS and [turn["turn"] for turn in turns] == [
                index // 2 for index in range(len(turns))
            ]
            rewards = [turn["turn_reward"] for turn in model_turns]  # the experience's, zero-padded to its batch's
            assert row["turn_rewards"] == rewards + [0.0] * (len(row["turn_rewards"]) - len(rewards))
            assert sum(row["turn_rewards"]) == pytest.approx(row["scores"])
            assert all(turn["turn_reward"] is None for turn in turns if turn["role"] == "user")
            assert [turn["done"] for turn in turns] == [False] * (len(turns) - 1) + [True]
            assert turns[-1]["stop_reason"] in ("done", "max_turns")
            assert len({turn["environment_seed"] for turn in turns}) == 1
            # The action mask is exactly the model's turns, each at most a turn's budget, and their tokens the
            # engine's: its log-probs of them are the trainer's forward (fp32), and the policy's own (digits, end).
            actions = [False] * window
            for turn in model_turns:
                assert 1 <= turn["token_stop"] - turn["token_start"] <= MAX_TOKENS_PER_TURN
                actions[turn["token_start"] : turn["token_stop"]] = [True] * (turn["token_stop"] - turn["token_start"])
            assert row["action_mask"] == actions
            sampled = [token for token, action in zip(row["response_ids"], actions, strict=True) if action]
            assert set(sampled) <= allowed, sampled
            for engine, trainer, action in zip(row["engine_logprobs"], row["old_logprobs"], actions, strict=True):
                assert abs(engine - trainer) < 1e-4 if action else engine == trainer == 0.0
        seeds = [turns[0]["environment_seed"] for _, turns in episodes]
        assert len(set(seeds)) == len(seeds)


def test_the_probe_gate_proved_every_swap_of_the_episodes(engine_run):
    """The rollout's, the reference's and evaluation's held-out episodes each sampled from swaps the gate proved, and
    iteration 1's rollout from the PPO update's weights; evaluation keeps the mismatch as single-turn evaluation does."""
    stages = {stage: _outputs(engine_run, stage) for stage in ("rollout", "sample_reference", "evaluate")}
    assert [len(outputs) for outputs in stages.values()] == [2, 1, 2]
    for stage, outputs in stages.items():
        for _, folder in outputs:
            manifest = _manifest(folder)
            swaps = manifest["runtime"]["engine_probe"]
            assert swaps and all(swap["gap"] <= swap["tolerance"] == 1e-4 for swap in swaps), (stage, swaps)
            assert manifest["metrics"]["engine_probe_gap"] < 1e-4, (stage, manifest["metrics"])
    (_, later), (_, update) = stages["rollout"][1], _outputs(engine_run, "ppo_update")[0]
    assert any(swap["weights"] == str(update / "actor") for swap in _manifest(later)["runtime"]["engine_probe"])
    for _, folder in stages["evaluate"]:
        metrics = _metrics(folder)
        assert {"reward_mean", "reference_reward_mean", "success", "turns_mean"} <= set(metrics), metrics
        assert metrics["engine_logprob_max_abs_diff"] < 1e-4, metrics


def test_the_first_rollout_on_hf_and_on_the_engine_play_the_same_episodes_in_the_same_shape(
    engine_run, digit_world, tmp_path
):
    """Other samplers, other tokens: the same episodes (rows, prompts, the environment's first messages as the same
    ids, its seeds), in the same tables."""
    _run_to_end(_command(tmp_path, digit_world, "iterations=1", "sampling.engine=hf"), tmp_path / "run.log")
    (_, hf), (_, engine) = _outputs(tmp_path, "rollout")[0], _outputs(engine_run, "rollout")[0]
    for table in ("experience", "turns"):
        assert read_table(hf, table).schema == read_table(engine, table).schema, table
    for (ours, our_turns), (theirs, their_turns) in zip(_episodes(hf), _episodes(engine), strict=True):
        for name in ("row", "prompt_id", "prompt_ids"):
            assert ours[name] == theirs[name], name
        assert our_turns[0]["environment_seed"] == their_turns[0]["environment_seed"]
        assert len(ours["response_ids"]) == len(ours["action_mask"]) == len(ours["engine_logprobs"])
        assert 1 <= len(ours["turn_rewards"]) <= MAX_TURNS
    assert "engine_probe" not in _manifest(hf).get("runtime", {})  # the hf sampler is the trainer's model: no gate
