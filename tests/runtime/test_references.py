"""Judges by name: loading, refusals, and references keyed by their code."""

from __future__ import annotations

import pytest

from demo.gold import JUDGE, gold_score
from runtime.references import JudgeReference, load_judge, load_object


def test_the_demo_judge_loads_by_name_and_scores_like_the_rubric():
    judge = load_judge("demo.gold:JUDGE")
    assert judge is JUDGE
    assert judge.score("the cat", "is happy .") == gold_score("the cat", "is happy .")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("demo.gold", "must look like `module:attribute`"),
        ("no_such_module:x", "cannot import module"),
        ("demo.gold:NOTHING", "has no attribute"),
        ("demo.gold:gold_score", "is not a judge"),
    ],
)
def test_bad_names_are_refused_with_the_reason(name, message):
    with pytest.raises(ValueError, match=message):
        load_judge(name)


def test_a_reference_carries_its_code_fingerprint():
    reference = JudgeReference.of("demo.gold:JUDGE")
    assert reference.name == "demo.gold:JUDGE" and len(reference.code) == 64
    assert reference.load() is JUDGE
    assert load_object("demo.gold:GoldJudge.score") is JUDGE.score.__func__
