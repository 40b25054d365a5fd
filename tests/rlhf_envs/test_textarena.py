"""TextArena's games through the adapter (rlhf_envs/textarena.py), played by the runner in its child process as any
environment is: the game's own first message, only the new messages at each turn, its end-of-game reward on the last
turn; the model one player of a two-player game against a scripted opponent; an episode that depends on its seed alone.

GuessTheNumber-v0's secret for seed s is ``random.Random(s).randint(1, 20)`` (TextArena seeds Python's ``random``
with the seed, then draws the number): 13 for seed 0.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("textarena", reason="TextArena is not installed (pip install 'rlhf-pipeline[textarena]')")

from rlhf_envs.textarena import TextArena  # noqa: E402
from runtime.environments import DONE, EnvironmentReply, EnvironmentRunner  # noqa: E402
from runtime.references import EnvironmentReference  # noqa: E402

GUESS = {"prompt": "", "env_id": "GuessTheNumber-v0", "num_players": 1}


@pytest.fixture(scope="module")
def runner():
    """A runner of Tic Tac Toe against a scripted opponent (tests/environments.py), whose rows may name another game:
    one process, TextArena imported once."""
    with EnvironmentRunner(EnvironmentReference.of("tests.environments:TicTacToe"), step_timeout_s=20) as one:
        yield one


def test_a_single_player_game_is_an_episode_its_replies_the_new_messages_its_reward_the_games_at_the_end(runner):
    assert random.Random(0).randint(1, 20) == 13
    first = runner.reset("guess", seed=0, row=GUESS)
    assert first.observation.startswith("[GAME] You are Player 0. You are playing Guess The Number.\n")
    assert first.observation.endswith("Enter your guess.") and (first.reward, first.done) == (0.0, False)
    # 12 is low, "15" (the plain id's action wrapper brackets it: [15]) is high, 13 wins: 1 for the win.
    replies = [runner.step("guess", action) for action in ("[12]", "15", "I say [13]")]
    assert replies == [
        EnvironmentReply("[GAME] The target number is higher.", 0.0, False, None),
        EnvironmentReply("[GAME] The target number is lower.", 0.0, False, None),
        EnvironmentReply(None, 1.0, True, DONE),
    ]


def test_an_episode_depends_on_its_seed_and_actions_alone_and_leaves_the_process_random_as_it_was():
    def play(seed: int) -> list:
        game = TextArena()
        return [game.reset(seed=seed, row=GUESS), *(game.step(f"[{n}]") for n in (10, 15))]

    random.seed(123)
    before = random.getstate()
    interleaved = TextArena(), TextArena()
    interleaved[0].reset(seed=0, row=GUESS)
    interleaved[1].reset(seed=1, row=GUESS)
    steps = [interleaved[0].step("[10]"), interleaved[1].step("[10]"), interleaved[0].step("[15]")]
    assert random.getstate() == before
    assert steps[0::2] == play(0)[1:] and steps[1] == play(1)[1]
    assert play(0) == play(0)


def test_the_model_plays_one_player_and_the_opponent_the_other_until_the_game_ends(runner):
    # The model is player 0 (O); the opponent (X) takes the first free cell. O: 4, X: 0, O: 3, X: 1, O: 5 wins.
    first = runner.reset("win", seed=0, row={"prompt": ""})
    assert first.observation.startswith("[GAME] You are Player 0 in Tic Tac Toe.")
    second = runner.step("win", "[4]")
    assert "[Player 1] [0]" in second.observation and "[Player 0]" not in second.observation
    assert [runner.step("win", move) for move in ("[3]", "[5]")][-1] == EnvironmentReply(None, 1.0, True, DONE)
    # As player 1 (X) the opponent opens: O: 0, X: 4, O: 1, X: 8, O: 2 wins; a loss is -1.
    opened = runner.reset("lose", seed=0, row={"prompt": "", "player": 1})
    assert "[Player 0] [0]" in opened.observation
    assert [runner.step("lose", move) for move in ("[4]", "[8]")][-1] == EnvironmentReply(None, -1.0, True, DONE)


def test_a_game_of_more_players_than_the_class_plays_or_no_game_is_refused_at_the_reset():
    """In the runner's process either is an episode ended at its reset with this error as its stop reason."""
    with pytest.raises(NotImplementedError) as unplayed:
        TextArena().reset(seed=0, row={"prompt": "", "env_id": "TicTacToe-v0", "num_players": 2})
    assert str(unplayed.value) == (
        "TicTacToe-v0 is played by 2 players and TextArena has no opponent: define "
        "`opponent(self, player, observation) -> str` in a subclass (docs/environments.md)"
    )
    with pytest.raises(ValueError, match="no TextArena game to play: the prompt's row has no `env_id` column"):
        TextArena().reset(seed=0, row={"prompt": ""})


def test_a_tiny_chat_policy_plays_the_game_token_in_token_out_the_games_messages_as_template_deltas(runner):
    """The rollout's own episode loop (tasks.episodes.play_episodes) on a tiny random ChatML policy: the game opens
    the conversation; after each model turn only the game's new message is appended, as the template's delta."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.config import SamplingConfig
    from tasks.episodes import ASSISTANT, USER, play_episodes
    from tasks.text import Prompt
    from tests.conftest import byte_level_bpe, tiny_config

    tokenizer = byte_level_bpe(vocab_size=300)
    config = tiny_config("qwen2", vocab_size=len(tokenizer))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    prompts = [(index, 0, Prompt("", (), GUESS)) for index in range(2)]
    with torch.no_grad():
        episodes = play_episodes(
            runner, policy, tokenizer, prompts, seed=0, iteration=0, sampling=SamplingConfig(batch_size=2),
            max_turns=2, max_tokens_per_turn=4, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    for episode in episodes:
        assert episode.messages[0]["content"].startswith("[GAME] You are Player 0. You are playing Guess The Number.")
        assert [segment["role"] for segment in episode.segments] == [ASSISTANT, USER, ASSISTANT]
        reply = episode.segments[1]
        delta = tokenizer.decode(episode.response[reply["token_start"] : reply["token_stop"]])
        assert delta.endswith(f"<|im_start|>user\n{episode.messages[2]['content']}<|im_end|>\n<|im_start|>assistant\n")
        assert episode.messages[2]["content"].startswith("[GAME] ") and "You are Player 0" not in delta
        # A random model names no number: an invalid move, told so; TextArena allows one, so the second ends the game
        # (done) with its end reward, 0.0 for a game with no valid guess.
        assert episode.messages[2]["content"].startswith("[GAME] You attempted an invalid move.")
        assert episode.stop_reason == "done" and episode.turn_rewards == [0.0, 0.0]
