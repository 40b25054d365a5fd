"""Labelers: the rubric labeler (``function``) prefers what the user's reward function scores higher."""

from __future__ import annotations

import pytest

from runtime.references import RewardFunctionError
from tasks.labelers import CandidatePair, FunctionLabeler, Label
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


def test_issue23_a_rubric_reads_the_other_columns_of_each_candidates_prompt_row():
    import pyarrow as pa

    from storage.schemas import CANDIDATES
    from tasks.collect_preferences import candidate_pairs

    rows = [
        {"prompt_id": prompt_id, "candidate_index": index, "prompt": f"Capital of {country}?", "messages": [],
         "response": response, "prompt_ids": [1], "response_ids": [2]}
        for prompt_id, country, responses in ((0, "France", ("Paris.", "Lyon.")), (1, "Italy", ("Milan.", "Rome.")))
        for index, response in enumerate(responses)
    ]  # fmt: skip
    columns = [{"answer": "Paris"}, {"answer": "Rome"}]
    pairs = candidate_pairs(pa.Table.from_pylist(rows, schema=CANDIDATES), columns=columns)

    def exact(prompt, response, answer):
        return float(response.rstrip(".") == answer)

    assert FunctionLabeler(exact, "m:exact", render=lambda prompt: "<rendered>").label(pairs) == [
        Label(0, 1.0),
        Label(1, 1.0),
    ]
