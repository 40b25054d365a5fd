"""Tests for demo/corpus.py: determinism, sentence shape, prompt split, sentiment balance."""

from __future__ import annotations

from demo.corpus import (
    FUNCTION_WORDS,
    MAX_WORDS,
    MIN_WORDS,
    NEGATIVE_WORDS,
    POSITIVE_WORDS,
    VOCABULARY,
    WORD_CLASSES,
    generate_corpus,
    generate_prompts,
    grammatical_bigrams,
)


def test_corpus_is_deterministic_given_the_seed():
    assert generate_corpus(300, seed=3) == generate_corpus(300, seed=3)
    assert generate_corpus(300, seed=3) != generate_corpus(300, seed=4)


def test_sentences_are_short_finished_and_in_vocabulary():
    vocabulary = set(VOCABULARY)
    for sentence in generate_corpus(2000, seed=0):
        words = sentence.split(" ")
        assert MIN_WORDS <= len(words) <= MAX_WORDS
        assert words[-1] == "." and words.count(".") == 1
        assert set(words) <= vocabulary


def test_vocabulary_size_and_word_classes_are_disjoint():
    assert 150 <= len(VOCABULARY) <= 260
    assert len(set(VOCABULARY)) == len(VOCABULARY)
    assert POSITIVE_WORDS.isdisjoint(NEGATIVE_WORDS)
    assert (POSITIVE_WORDS | NEGATIVE_WORDS).isdisjoint(FUNCTION_WORDS)


def test_corpus_is_sentiment_neutral_on_average():
    words = [word for sentence in generate_corpus(5000, seed=0) for word in sentence.split()]
    positive = sum(word in POSITIVE_WORDS for word in words)
    negative = sum(word in NEGATIVE_WORDS for word in words)
    # About 0.55 of each per sentence; a 5% relative gap is far outside sampling noise at this size.
    assert abs(positive - negative) < 0.05 * (positive + negative) / 2


def test_prompts_are_distinct_short_beginnings_and_train_eval_disjoint():
    train, held_out = generate_prompts(256, 64, seed=0)
    assert (len(train), len(held_out)) == (256, 64)
    assert len(set(train)) == 256 and len(set(held_out)) == 64
    assert set(train).isdisjoint(held_out)
    assert all(2 <= len(prompt.split()) <= 4 and "." not in prompt for prompt in train + held_out)
    assert generate_prompts(256, 64, seed=0) == (train, held_out)


def test_grammatical_bigrams_are_complete_and_cover_the_corpus():
    # Ten times the sample finds no new pair (the rarest pair shows up ~18 times in the default sample).
    assert grammatical_bigrams(500_000) == grammatical_bigrams()
    for sentence in generate_corpus(500, seed=7):
        classes = [WORD_CLASSES[word] for word in sentence.split()]
        assert set(zip(classes, classes[1:], strict=False)) <= grammatical_bigrams()
    assert ("positive_adjective", "positive_adjective") not in grammatical_bigrams()
