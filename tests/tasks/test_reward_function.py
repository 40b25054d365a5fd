"""Reward functions by name: loading, keyed by their code, and refusing what would train on a broken reward."""

from __future__ import annotations

import pytest
import torch

from demo.gold import gold_score
from tasks.reward_function import RewardFunctionError, RewardFunctionReference, load_reward_function, score_texts


def test_the_demo_rubric_loads_by_name_and_is_keyed_by_its_code():
    reference = RewardFunctionReference.of("demo.gold:gold_score")
    assert reference.load() is gold_score and len(reference.code) == 64
    scores = score_texts(reference.load(), reference.name, ["the cat"], ["is happy ."], [7])
    assert scores.dtype == torch.float32 and scores.tolist() == [pytest.approx(gold_score("the cat", "is happy ."))]


@pytest.mark.parametrize(
    ("name", "message"),
    [("demo.gold", "must look like `module:attribute`"), ("demo.gold:POSITIVE_CAP", "is not a reward function")],
)
def test_bad_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        load_reward_function(name)


def _raises(prompt: str, response: str) -> float:
    if prompt == "b":
        raise KeyError("no answer key")
    return 1.0


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (_raises, r"f raised on prompt 42 \('b', response 'y'\): KeyError"),
        (lambda prompt, response: float("inf") if prompt == "b" else 0.0, r"f returned inf for prompt 42"),
        (lambda prompt, response: None if prompt == "b" else 0.0, r"f returned None for prompt 42"),
        (lambda prompt, response: True if prompt == "b" else 0.0, r"f returned True for prompt 42"),
    ],
)
def test_a_function_that_raises_or_returns_no_finite_number_names_the_prompt(function, message):
    with pytest.raises(RewardFunctionError, match=message):
        score_texts(function, "f", ["a", "b"], ["x", "y"], [41, 42])
