"""Reward functions by name: loading, keyed by their code, the contract they are called with (the prompt as the
user wrote it, the row's other columns, the rendered prompt on request), and refusing what would train on a broken
reward, before anything runs where it can."""

from __future__ import annotations

import importlib
import uuid
from types import MappingProxyType

import pytest
import torch

from demo.gold import gold_score
from runtime.references import RewardFunctionError, RewardFunctionReference, load_reward_function
from tasks.reward_function import check_reward_function, score_texts
from tasks.text import Prompt

CHAT = Prompt(
    "\n\nHuman: 2 + 2?\n\nAssistant:",
    ({"role": "user", "content": "2 + 2?"},),
    MappingProxyType({"answer": "4", "topic": "sums"}),
)
RENDERED = "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def _score(function, prompts, responses, ids=None, texts=None):
    ids = ids if ids is not None else list(range(len(prompts)))
    texts = texts if texts is not None else [prompt.text for prompt in prompts]
    return score_texts(function, "f", prompts, responses, ids, prompt_texts=texts)


def test_the_demo_rubric_loads_by_name_and_is_keyed_by_its_code():
    reference = RewardFunctionReference.of("demo.gold:gold_score")
    assert reference.load() is gold_score and len(reference.code) == 64
    scores = _score(reference.load(), [Prompt("the cat")], ["is happy ."])
    assert scores.dtype == torch.float32 and scores.tolist() == [pytest.approx(gold_score("the cat", "is happy ."))]


def test_issue23_a_chat_prompt_arrives_as_its_messages_with_its_rows_columns():
    seen = []

    def exact(prompt, response, answer, topic):
        seen.append((prompt, answer, topic))
        return float(response.strip() == answer)

    assert _score(exact, [CHAT, CHAT], ["4", "5"]).tolist() == [1.0, 0.0]
    assert seen[0] == ([{"role": "user", "content": "2 + 2?"}], "4", "sums")


def test_issue23_the_rendered_prompt_arrives_only_where_the_function_asks_for_it():
    seen = {}

    def wants(prompt, response, prompt_text, **columns):
        seen.update(prompt_text=prompt_text, columns=columns)
        return 0.0

    _score(wants, [CHAT], ["4"], texts=[RENDERED])
    assert seen == {"prompt_text": RENDERED, "columns": {"answer": "4", "topic": "sums"}}
    _score(lambda prompt, response, **columns: float("prompt_text" in columns), [CHAT], ["4"], texts=[RENDERED])


def test_issue23_a_plain_prompt_arrives_as_its_text():
    assert _score(lambda prompt, response: float(prompt == "the sun"), [Prompt("the sun")], ["x"]).tolist() == [1.0]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("demo.gold", "must look like `module:attribute`"),
        ("demo.gold:POSITIVE_CAP", "is not a reward function"),
        ("no_such_module_here:reward", "cannot import module 'no_such_module_here'"),
        ("demo.gold:no_such_function", "has no attribute 'no_such_function'"),
    ],
)
def test_issue23_bad_names_are_refused_naming_the_setting(name, message):
    with pytest.raises(RewardFunctionError, match=message) as refused:
        load_reward_function(name)
    assert str(refused.value).startswith("`reward.function`") and "\n" not in str(refused.value)


def _raises(prompt, response: str) -> float:
    if prompt == "b":
        raise KeyError("no answer key")
    return 1.0


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (_raises, r"`reward.function` f raised on prompt 42 \('b', response 'y'\): KeyError"),
        (lambda prompt, response: float("inf") if prompt == "b" else 0.0, r"f returned inf for prompt 42"),
        (lambda prompt, response: None if prompt == "b" else 0.0, r"f returned None for prompt 42"),
        (lambda prompt, response: True if prompt == "b" else 0.0, r"f returned True for prompt 42"),
    ],
)
def test_a_function_that_raises_or_returns_no_finite_number_names_the_prompt(function, message):
    with pytest.raises(RewardFunctionError, match=message):
        _score(function, [Prompt("a"), Prompt("b")], ["x", "y"], ids=[41, 42])


def _reference(tmp_path, monkeypatch, source: str) -> RewardFunctionReference:
    """``reward`` in a new module of ``source`` (a name of its own: a module imported once stays imported)."""
    name = f"user_rewards_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return RewardFunctionReference.of(f"{name}:reward")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "def reward(prompt, response):\n    return 1.0\n",
            r"cannot be called .* columns of `data.prompts` \(answer, topic\)",
        ),
        ("def reward(prompt, response, answer, level):\n    return 1.0\n", r"missing a required argument: 'level'"),
        ("def reward(prompt, response, **c):\n    return c['missing']\n", r"raised on prompt row 1 of `data.prompts`"),
        ("def reward(prompt, response, **c):\n    return 'high'\n", r"returned 'high' for prompt row 1"),
    ],
    ids=["no-columns", "a-column-the-file-lacks", "raises", "not-a-number"],
)
def test_issue23_the_check_before_anything_runs_refuses_a_function_the_rollout_could_not_call(
    tmp_path, monkeypatch, source, message
):
    reference = _reference(tmp_path, monkeypatch, source)
    with pytest.raises(RewardFunctionError, match=message) as refused:
        check_reward_function(reference, [("data.prompts", CHAT, RENDERED)])
    assert str(refused.value).startswith(f"`reward.function` {reference.name}") and "\n" not in str(refused.value)


def test_issue23_the_check_calls_the_function_once_on_the_first_sample(tmp_path, monkeypatch):
    reference = _reference(
        tmp_path,
        monkeypatch,
        "CALLS = []\ndef reward(prompt, response, **c):\n    CALLS.append(response)\n    return 0\n",
    )
    check_reward_function(reference, [("data.prompts", CHAT, RENDERED), ("data.eval_prompts", CHAT, RENDERED)])
    assert importlib.import_module(reference.name.partition(":")[0]).CALLS == [""]
