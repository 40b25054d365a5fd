"""The hidden gold preference: a fixed rubric that plays the human rater in the demo world.

The pipeline never sees this rubric. It only sees which of two responses the rater preferred
(:func:`gold_prefers`), and evaluation reports :func:`gold_score` to show whether the policy
moved the way the rater wanted, and how far the learned reward drifted from it.

Rubric, for a response split on whitespace into words (``.`` is a word):

1. **Sentiment.** Each *distinct* positive word (:data:`demo.corpus.POSITIVE_WORDS`) adds its
   weight, in total at most ``POSITIVE_CAP = 3.0``; *every* negative word
   (:data:`demo.corpus.NEGATIVE_WORDS`) subtracts its weight. Weights lie in [0.75, 1.25], fixed per
   word by a hash, so "lovely" and "kind" are not worth exactly the same.
2. **Taste.** Every other non-function word (nouns, names, neutral adjectives, verbs and adverbs)
   adds a small fixed amount in [-0.1, 0.1] from a hash of the word: the rater's idiosyncrasy. It
   makes ties between different responses rare and gives a reward model something subtle to get
   wrong.
3. **Repetition.** Each occurrence of a non-function word already seen in the prompt or earlier
   in the response costs ``REPEAT_PENALTY = 1.0`` (and a repeated positive word earns nothing).
4. **Grammar.** Each pair of adjacent words (the prompt's last word and the response's first
   included) whose word classes the grammar never puts side by side
   (:func:`demo.corpus.grammatical_bigrams`, e.g. two quality adjectives in a row, a noun followed
   by a determiner, any unknown word) costs ``UNGRAMMATICAL_PENALTY = 1.0``.
5. **Completeness.** A response must be exactly one finished sentence: its last word is ``.`` and
   no other word is. Otherwise (cut off, empty, or run on) it costs ``INCOMPLETE_PENALTY = 2.0``.
6. **Length.** Each word beyond ``MAX_WORDS = 12`` costs ``LENGTH_PENALTY = 0.25``.

Why this shape: (a) the base policy's samples vary, because the corpus fills each sentiment slot
positive or negative with equal odds (standard deviation about 1.3 per sample); (b) a policy raises
the score by swapping single words, so PPO has a short path to follow; (c) the cap, the repetition
penalty, the grammar check and the completeness and length penalties make degenerate text ("happy
happy happy", a list of adjectives, "a happy a kind a lovely") score worse than a plain cheerful
sentence. The grammar check is local (word-class bigrams), so a reward model that learned only
"positive words are good" can still be exploited where the gold rater cannot: that gap is what the
demo's evaluation shows.
"""

from __future__ import annotations

import hashlib

from demo.corpus import FUNCTION_WORDS, NEGATIVE_WORDS, POSITIVE_WORDS, WORD_CLASSES, grammatical_bigrams

POSITIVE_CAP = 3.0
REPEAT_PENALTY = 1.0
UNGRAMMATICAL_PENALTY = 1.0
INCOMPLETE_PENALTY = 2.0
MAX_WORDS = 12
LENGTH_PENALTY = 0.25
TASTE_SCALE = 0.1


def _unit_hash(text: str, *, salt: str) -> float:
    """A stable number in [0, 1) for ``text`` (independent of ``PYTHONHASHSEED``)."""
    digest = hashlib.blake2b(f"{salt}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def sentiment_weight(word: str) -> float:
    """How much a sentiment word counts, in [0.75, 1.25] (its sign comes from its list)."""
    return 0.75 + 0.5 * _unit_hash(word, salt="sentiment")


def taste(word: str) -> float:
    """The rater's small fixed liking for a neutral word, in [-0.1, 0.1]."""
    return TASTE_SCALE * (2.0 * _unit_hash(word, salt="taste") - 1.0)


def count_ungrammatical_pairs(words: list[str]) -> int:
    """How many adjacent pairs of ``words`` have classes the grammar never puts side by side."""
    allowed = grammatical_bigrams()
    classes = [WORD_CLASSES.get(word, "unknown") for word in words]
    return sum(pair not in allowed for pair in zip(classes, classes[1:], strict=False))


def gold_score(prompt: str, response: str) -> float:
    """The rubric's score of ``response`` as a continuation of ``prompt`` (see the module docstring).

    Args:
        prompt: the sentence beginning, e.g. ``"the old dog"``.
        response: the generated continuation as decoded text, e.g. ``"found a lovely ball ."``.

    Returns:
        The score, rounded to 6 decimals so word order cannot change it through float rounding.
        Typically -4 (a cut-off, gloomy, garbled response) to +3 (the positive cap).
    """
    words = response.split()
    seen = {word for word in prompt.split() if word not in FUNCTION_WORDS}
    positive_credit, score = 0.0, 0.0
    for word in words:
        if word in FUNCTION_WORDS:
            continue
        if word in NEGATIVE_WORDS:
            score -= sentiment_weight(word)
        if word in seen:
            score -= REPEAT_PENALTY
            continue
        seen.add(word)
        if word in POSITIVE_WORDS:
            positive_credit += sentiment_weight(word)
        elif word not in NEGATIVE_WORDS:
            score += taste(word)
    score += min(positive_credit, POSITIVE_CAP)
    score -= UNGRAMMATICAL_PENALTY * count_ungrammatical_pairs(prompt.split()[-1:] + words)
    if words.count(".") != 1 or words[-1] != ".":
        score -= INCOMPLETE_PENALTY
    score -= LENGTH_PENALTY * max(0, len(words) - MAX_WORDS)
    return round(score, 6)


def gold_prefers(prompt: str, response_a: str, response_b: str) -> tuple[int, float]:
    """Which of two responses the gold rater prefers.

    Ties in score are broken by a stable hash of each response, so swapping the arguments flips
    the choice (``gold_prefers(p, a, b) == (1 - i, m)`` when ``gold_prefers(p, b, a) == (i, m)``)
    unless the two texts are identical, where the answer is 0 both ways.

    Args:
        prompt: the shared prompt.
        response_a: first candidate.
        response_b: second candidate.

    Returns:
        ``(choice, margin)``: choice 0 if ``response_a`` is preferred, 1 if ``response_b``; margin
        is the absolute score gap (0.0 for a tie).
    """
    score_a, score_b = gold_score(prompt, response_a), gold_score(prompt, response_b)
    if score_a != score_b:
        return (0 if score_a > score_b else 1), round(abs(score_a - score_b), 6)
    hash_a = _unit_hash(f"{prompt}\x00{response_a}", salt="tie")
    hash_b = _unit_hash(f"{prompt}\x00{response_b}", salt="tie")
    return (1 if hash_b < hash_a else 0), 0.0


class GoldJudge:
    """The hidden gold rater as a :class:`rlhf_core.evaluation.Judge`: the pipeline reaches it as ``demo.gold:JUDGE``."""

    def score(self, prompt: str, response: str) -> float:
        return gold_score(prompt, response)

    def prefers(self, prompt: str, first: str, second: str) -> tuple[int, float]:
        return gold_prefers(prompt, first, second)


JUDGE = GoldJudge()
"""The demo's gold judge (``judge: demo.gold:JUDGE``)."""
