"""Issue 44: episodes played turn by turn (tasks/episodes.py), with the environment in this process (a stand-in for
:class:`runtime.environments.EnvironmentRunner`, whose own tests are tests/runtime/test_environments.py); the
campaign through the flows is tests/flows/test_episodes.py."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import SamplingConfig
from runtime.environments import DONE, EnvironmentReply, error_reason
from storage.experience_io import table_to_experience
from storage.schemas import EPISODES, TURNS, conform
from tasks.episodes import episode_table, play_episodes, turns_table
from tasks.sft_text import turn_delta
from tasks.text import Prompt
from tests.conftest import byte_level_bpe, tiny_config
from tests.environments import Faulty


class InProcess:
    """The runner's interface, the environments in this process; failures become stop reasons as the runner's do."""

    def __init__(self, environment: type) -> None:
        self.environment, self.live = environment, {}

    def reset(self, key, *, seed: int, row: dict) -> EnvironmentReply:
        self.live[key] = self.environment()
        try:
            observation = self.live[key].reset(seed=seed, row=row)
            if not isinstance(observation, str):
                raise TypeError(f"reset returned {observation!r}")
            return EnvironmentReply(observation, 0.0, False, None)
        except Exception as error:  # noqa: BLE001 - as the runner's process
            return EnvironmentReply(None, 0.0, True, error_reason(type(error).__name__, str(error)))

    def step(self, key, action: str) -> EnvironmentReply:
        try:
            observation, reward, done = self.live[key].step(action)
        except Exception as error:  # noqa: BLE001
            return EnvironmentReply(None, 0.0, True, error_reason(type(error).__name__, str(error)))
        return EnvironmentReply(observation, reward, done, DONE if done else None)

    def end(self, key) -> None:
        self.live.pop(key, None)


@pytest.fixture(scope="module")
def chat_policy():
    tokenizer = byte_level_bpe(vocab_size=400, corpus=["I am thinking of a number from 1 to 4. Higher. Lower."] * 20)
    config = tiny_config("qwen2", vocab_size=len(tokenizer))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config), tokenizer


def test_episodes_keep_the_sampled_ids_and_append_the_template_delta_and_failures_are_rows(chat_policy):
    actor, tokenizer = chat_policy
    prompts = [
        (0, 0, Prompt("Guess.", columns={"high": 4})),
        (0, 1, Prompt("Guess.", columns={"high": 4})),
        (1, 0, Prompt("Again.", columns={"high": 4, "raise_at": 2})),
        (2, 0, Prompt("Start.", columns={"reset": "number"})),
    ]
    episodes = play_episodes(
        InProcess(Faulty),
        actor,
        tokenizer,
        prompts,
        seed=0,
        iteration=0,
        sampling=SamplingConfig(max_new_tokens=8, batch_size=3),
        max_turns=3,
        max_tokens_per_turn=5,
        generator=torch.Generator().manual_seed(0),
    )
    assert [episode.stop_reason.split(":")[0] for episode in episodes[2:]] == ["error", "error"]
    assert episodes[3].response == []  # its reset failed: no turn at all, one empty segment saying why
    assert [(s["role"], s["token_stop"], s["done"]) for s in episodes[3].segments] == [("user", 0, True)]
    first = episodes[0]
    assert len(first.segments) == 5 and first.stop_reason == "max_turns"  # a random model does not guess
    for segment in first.segments:
        ids = first.response[segment["token_start"] : segment["token_stop"]]
        assert first.actions[segment["token_start"] : segment["token_stop"]] == [segment["role"] == "assistant"] * len(
            ids
        )
    turn = first.segments[0]
    sampled = first.response[turn["token_start"] : turn["token_stop"]]
    reply = first.segments[1]
    conversation = first.messages[:3]  # the first message, the model's, the environment's reply
    ended = sampled[-1] == tokenizer.eos_token_id
    assert first.response[reply["token_start"] : reply["token_stop"]] == turn_delta(
        tokenizer, conversation, ended=ended
    )
    assert reply["observation_sha256"] == hashlib.sha256(conversation[2]["content"].encode()).hexdigest()
    assert turn["observation_sha256"] is None  # the model's turn: no observation

    table = conform(
        episode_table(
            episodes, actor, None, actor, pad_token_id=tokenizer.pad_token_id, temperature=1.0, precision="fp32",
            first_row=10, policy_version=3,
        ),
        EPISODES,
    )  # fmt: skip
    experience = table_to_experience(table.drop_columns([TURNS, "drifts"]), pad_token_id=tokenizer.pad_token_id)
    assert experience.action_mask[0].sum() == sum(first.actions) and not experience.action_mask[2:].any()
    assert experience.scores.tolist() == [sum(episode.turn_rewards) for episode in episodes]
    turns = turns_table(table)
    assert turns.num_rows == sum(len(episode.segments) for episode in episodes)
    assert set(turns.column("row").to_pylist()) == {10, 11, 12, 13} and set(
        turns.column("policy_version").to_pylist()
    ) == {3}


def test_issue44_a_rollout_whose_episodes_all_failed_is_refused_in_one_line_naming_the_failure():
    from tasks.episodes import EveryEpisodeFailed, check_some_episode_ended

    check_some_episode_ended(["done", "error: ValueError: bad", "max_turns"], 3)  # one failure: a row, not a refusal
    with pytest.raises(EveryEpisodeFailed, match=r"every one of the 3 episodes .* \(`timeout` 2 times\)") as refused:
        check_some_episode_ended(["timeout", "error: ValueError: bad", "timeout"], 3)
    assert "\n" not in str(refused.value)
    with pytest.raises(EveryEpisodeFailed, match="at its reset, before any sampling"):
        check_some_episode_ended(["timeout"], 1, when=" at its reset, before any sampling")


def test_issue44_episodes_whose_every_reset_fails_are_refused_before_any_sampling(chat_policy):
    from tasks.episodes import EveryEpisodeFailed

    actor, tokenizer = chat_policy
    sampled = []
    hook = actor.register_forward_hook(lambda *_: sampled.append(1))  # the model never runs
    try:
        with pytest.raises(
            EveryEpisodeFailed, match="every one of the 2 episodes .* at its reset, before any sampling"
        ):
            play_episodes(
                InProcess(Faulty), actor, tokenizer,
                [(0, 0, Prompt("Start.", columns={"reset": "number"})), (1, 0, Prompt("Go.", columns={"reset": "number"}))],
                seed=0, iteration=0, sampling=SamplingConfig(max_new_tokens=8, batch_size=3), max_turns=3,
                max_tokens_per_turn=5, generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
    finally:
        hook.remove()
    assert not sampled


class RowSeeded:
    """An :class:`rlhf_core.generation.ExternalSampler` that samples as the engine does, in this process: each row
    alone, from its own seed, with the model; it keeps every request it is sent."""

    def __init__(self, model) -> None:
        self.model, self.requests = model, []

    def sample(self, prompts, seeds, *, config, eos_token_id):
        from rlhf_core.generation import generate

        self.requests.append((prompts, seeds, config.max_new_tokens))
        tokens, logprobs = [], []
        for prompt, seed in zip(prompts, seeds, strict=True):
            ids = torch.tensor([prompt])
            generation = generate(
                self.model, ids, torch.ones_like(ids), config=config, eos_token_id=eos_token_id, pad_token_id=0,
                generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
            tokens.append(generation.sequences[0, ids.shape[1] :][generation.action_mask[0]].tolist())
            logprobs.append(generation.logprobs[0][generation.action_mask[0]].tolist())
        return tokens, logprobs


@pytest.mark.parametrize("batch_size", [1, 3])
def test_issue44_on_an_engine_each_turn_sends_every_live_episodes_ids_so_far_in_one_request_seeded_by_the_turn(
    chat_policy, batch_size
):
    """The engine's path through the episode player (tasks.sampler.WholeShards over a sampler that samples as the
    engine does): one request per turn holding every live episode's ids so far (its prompt, its turns as sampled and
    the deltas), each row seeded by runtime.seeds.turn_seed of its episode, the turn's budget as its tokens; the
    engine's tokens and log-probs kept as sampled, whatever the batch size."""
    from runtime.seeds import turn_seed
    from tasks.sampler import WholeShards
    from tests.environments import Guess

    actor, tokenizer = chat_policy
    engine = RowSeeded(actor)
    prompts = [(index, sample, Prompt("Guess.", columns={"high": 4})) for index in range(2) for sample in range(2)]
    episodes = play_episodes(
        InProcess(Guess), WholeShards(engine), tokenizer, prompts, seed=0, iteration=0,
        sampling=SamplingConfig(max_new_tokens=8, batch_size=batch_size), max_turns=3, max_tokens_per_turn=5,
        generator=None,
    )  # fmt: skip
    assert len(engine.requests) == max(len(episode.turn_rewards) for episode in episodes)  # one request per turn
    for turn, (sent, seeds, budget) in enumerate(engine.requests):
        live = [episode for episode in episodes if len(episode.turn_rewards) > turn]
        assert budget == 5 and seeds == [turn_seed(episode.seed, turn) for episode in live]
        starts = [[s for s in e.segments if s["role"] == "assistant"][turn]["token_start"] for e in live]
        assert sent == [e.prompt + e.response[:start] for e, start in zip(live, starts, strict=True)]
    for episode in episodes:
        turns = [s for s in episode.segments if s["role"] == "assistant"]
        for turn, segment in enumerate(turns):  # the engine's answer to that row, as sampled
            tokens, logprobs = engine.sample(
                [episode.prompt + episode.response[: segment["token_start"]]], [turn_seed(episode.seed, turn)],
                config=SamplingConfig(max_new_tokens=5), eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            assert episode.response[segment["token_start"] : segment["token_stop"]] == tokens[0]
            assert episode.logprobs[segment["token_start"] : segment["token_stop"]] == logprobs[0]
