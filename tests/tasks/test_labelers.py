"""Labelers: the rubric labeler (``function``) prefers what the user's reward function scores higher."""

from __future__ import annotations

import pytest

from tasks.labelers import CandidatePair, FunctionLabeler, Label
from tasks.reward_function import RewardFunctionError
from tasks.text import Prompt


def _pair(first: str, second: str) -> CandidatePair:
    return CandidatePair(Prompt("Name a fruit."), first, second, [1, 2], [1, 3])


def _words(prompt: str, response: str) -> float:  # the contract's (prompt, response, **columns)
    return -float(len(response.split()))  # fewer words is better


def test_the_function_labeler_prefers_the_higher_score_by_the_score_gap():
    pairs = [_pair("Apple.", "An apple a day."), _pair("I like pears.", "Pear."), _pair("Fig.", "Kiwi.")]
    labels = FunctionLabeler(_words, "m:words").label(pairs)
    # -1 vs -4: the first by 3; -3 vs -1: the second by 2; -1 vs -1: a tie keeps the first, margin 0
    assert labels == [Label(0, 3.0), Label(1, 2.0), Label(0, 0.0)]
    assert FunctionLabeler.name == "function"


def test_a_rubric_that_fails_is_named_with_the_pair():
    def broken(prompt: str, response: str) -> float:
        return float("nan") if response == "Pear." else 0.0

    with pytest.raises(RewardFunctionError, match=r"m:broken returned nan for prompt of pair 1"):
        FunctionLabeler(broken, "m:broken").label([_pair("Fig.", "Kiwi."), _pair("Apple.", "Pear.")])
