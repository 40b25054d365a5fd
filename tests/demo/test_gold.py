"""Tests for demo/gold.py: hand-checked rubric cases, anti-hacking properties, antisymmetry of preferences."""

from __future__ import annotations

import random

import pytest

from demo.corpus import POSITIVE_ADJECTIVES, generate_corpus
from demo.gold import (
    INCOMPLETE_PENALTY,
    LENGTH_PENALTY,
    POSITIVE_CAP,
    REPEAT_PENALTY,
    UNGRAMMATICAL_PENALTY,
    count_ungrammatical_pairs,
    gold_prefers,
    gold_score,
    sentiment_weight,
    taste,
)


def test_weights_are_fixed_and_in_range():
    # Pinned: a changed hash would silently change every label in every cached run.
    assert sentiment_weight("lovely") == pytest.approx(sentiment_weight("lovely"))
    assert all(0.75 <= sentiment_weight(word) <= 1.25 for word in POSITIVE_ADJECTIVES)
    assert all(-0.1 <= taste(word) <= 0.1 for word in ("dog", "ball", "found", "anna"))
    assert gold_score("the old dog", "found a lovely ball .") == pytest.approx(
        round(taste("found") + sentiment_weight("lovely") + taste("ball"), 6)
    )


def test_hand_examples():
    # A bare full stop is a finished (if dull) sentence: nothing to add or subtract.
    assert gold_score("she smiled", ".") == 0.0
    # Empty or cut off: the completeness penalty.
    assert gold_score("she smiled", "") == -INCOMPLETE_PENALTY
    assert gold_score("the dog", "saw a lovely") == pytest.approx(
        taste("saw") + sentiment_weight("lovely") - INCOMPLETE_PENALTY, abs=1e-6
    )
    # Run-on: two full stops are not one finished sentence, and ". ." is not a grammatical pair.
    assert gold_score("she", "slept . .") == pytest.approx(
        taste("slept") - UNGRAMMATICAL_PENALTY - INCOMPLETE_PENALTY, abs=1e-6
    )
    # One word swap moves the score by the two sentiment weights.
    gap = gold_score("the dog", "found a lovely ball .") - gold_score("the dog", "found a cruel ball .")
    assert gap == pytest.approx(sentiment_weight("lovely") + sentiment_weight("cruel"), abs=1e-6)
    # Function words ("the", "a", "near", ".") carry nothing and may repeat freely.
    assert gold_score("the dog", "saw the cat near the lake .") == pytest.approx(
        taste("saw") + taste("cat") + taste("lake"), abs=1e-6
    )


def test_positive_credit_is_capped_and_repeats_are_penalised():
    # Four distinct positive words (praised, lovely, warm, happily), each worth >= 0.75: capped at 3.
    assert gold_score("she", "praised a lovely red kite near the warm lake happily .") == pytest.approx(
        POSITIVE_CAP + taste("red") + taste("kite") + taste("lake"), abs=1e-6
    )
    # The second "happy" earns nothing and costs the repeat penalty.
    assert gold_score("she felt", "happy and happy .") == pytest.approx(
        sentiment_weight("happy") - REPEAT_PENALTY, abs=1e-6
    )
    # Repeating a word from the prompt costs the same.
    assert gold_score("the dog", "saw the dog .") == pytest.approx(taste("saw") - REPEAT_PENALTY, abs=1e-6)
    # Every negative word subtracts, repeated or not.
    assert gold_score("she felt", "sad and sad .") == pytest.approx(
        -2 * sentiment_weight("sad") - REPEAT_PENALTY, abs=1e-6
    )


def test_word_class_pairs_the_grammar_never_makes_are_penalised():
    assert count_ungrammatical_pairs("the old dog found a bright red ball near the river .".split()) == 0
    assert count_ungrammatical_pairs("she felt happy kind lovely .".split()) == 2  # adjective, adjective
    assert count_ungrammatical_pairs("the dog the cat .".split()) == 1  # noun, determiner
    assert count_ungrammatical_pairs("the zebra .".split()) == 2  # unknown word
    # The prompt's last word and the response's first word form a pair too.
    assert gold_score("the old", "the ball .") == pytest.approx(taste("ball") - UNGRAMMATICAL_PENALTY, abs=1e-6)


def test_long_responses_pay_per_extra_word():
    # 15 words: "cat" repeated 6 times, 6 noun->determiner pairs, 3 words over the limit.
    response = " ".join(["the cat"] * 7) + " ."
    expected = taste("cat") - 6 * REPEAT_PENALTY - 6 * UNGRAMMATICAL_PENALTY - 3 * LENGTH_PENALTY
    assert gold_score("she saw", response) == pytest.approx(expected, abs=1e-6)


def test_degenerate_text_scores_below_a_plain_cheerful_sentence():
    plain = gold_score("the old dog", "found a lovely ball near the river .")
    assert plain > 0.5
    for degenerate in (
        " ".join(["happy"] * 15),
        "happy happy happy happy .",
        "happy kind lovely warm gentle bright sweet .",
        "a happy a kind a lovely a warm .",
        "loved happily kindly gladly warmly .",
    ):
        assert gold_score("the old dog", degenerate) < plain, degenerate


def test_gold_prefers_is_antisymmetric_with_the_score_gap_as_margin():
    rng = random.Random(0)
    responses = [" ".join(sentence.split()[2:]) for sentence in generate_corpus(200, seed=1)]
    responses += ["saw a ball near the lake .", "saw the ball near a lake ."]  # a tie: same words
    for _ in range(500):
        a, b = rng.choice(responses), rng.choice(responses)
        if a == b:
            continue
        choice, margin = gold_prefers("the dog", a, b)
        assert gold_prefers("the dog", b, a) == (1 - choice, margin)
        assert margin == pytest.approx(abs(gold_score("the dog", a) - gold_score("the dog", b)))
        if margin > 0:
            assert (choice == 0) == (gold_score("the dog", a) > gold_score("the dog", b))


def test_ties_are_broken_by_text_and_identical_texts_choose_the_first():
    first, second = "saw a ball near the lake .", "saw the ball near a lake ."
    choice, margin = gold_prefers("the dog", first, second)
    assert margin == 0.0
    assert gold_prefers("the dog", second, first) == (1 - choice, 0.0)
    assert gold_prefers("the dog", first, first) == (0, 0.0)
