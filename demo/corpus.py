"""The demo world's language: a small English-like grammar, its lexicon, and the prompts drawn from it.

Choices:
1. Sentences are 5-14 words (the final ``.`` counts as a word) from five templates: transitive
   ("the old dog found a bright red ball near the river ."), intransitive, copula ("the soup was
   warm and lovely ."), "it was a lovely day", and reported speech ("she said that the cake was
   sweet .").
2. Sentiment lives in open slots only: quality adjectives, verbs, adverbs. Each slot draws its
   polarity first, with positive and negative equally likely, so the corpus is sentiment-neutral
   on average and a policy can raise the gold score by changing one word in a slot.
3. Nouns, names and function words are neutral, and their lists are disjoint from the sentiment
   lists, so :mod:`demo.gold` can score a word by list membership alone. Words also fall into
   classes (:data:`WORD_CLASSES`), and :func:`grammatical_bigrams` lists which classes can follow
   which: the gold rubric's cheap test of grammaticality.
4. Everything is lower case and words are separated by single spaces (``.`` too), so a word-level
   tokenizer covers the corpus with no unknown tokens.
5. Randomness comes from one ``random.Random(seed)`` per call: the same seed gives the same text.
"""

from __future__ import annotations

import functools
import random

DETERMINERS = ("the", "a", "my", "his", "her", "our", "their", "this", "that", "every")
SUBJECT_PRONOUNS = ("she", "he", "they", "we", "i")
PLURAL_SUBJECTS = frozenset({"they", "we"})
OBJECT_PRONOUNS = ("him", "her", "them", "it", "us", "me")
NAMES = ("anna", "tom", "lily", "max", "sam", "mia", "leo", "rosa")
ANIMAL_NOUNS = ("dog", "cat", "bird", "horse", "fox", "rabbit", "duck", "goat")
PEOPLE_NOUNS = (
    "girl", "boy", "man", "woman", "child", "teacher", "farmer", "baker",
    "doctor", "sailor", "king", "queen", "friend", "neighbour",
)  # fmt: skip
THING_NOUNS = (
    "ball", "box", "book", "letter", "cake", "apple", "bread", "soup", "cup", "hat",
    "coat", "lamp", "kite", "key", "chair", "table", "window", "door", "flower", "tree",
    "boat", "car", "bike", "song", "picture", "map", "basket", "blanket", "candle", "clock",
)  # fmt: skip
PLACE_NOUNS = (
    "river", "garden", "house", "street", "forest", "hill", "lake", "city", "village", "kitchen",
    "market", "school", "park", "bridge", "beach", "field", "road", "farm", "shop", "station",
)  # fmt: skip
NEUTRAL_ADJECTIVES = ("old", "young", "small", "big", "tall", "little", "round", "new", "long", "short", "heavy", "thin")  # fmt: skip
COLOUR_ADJECTIVES = ("red", "blue", "green", "yellow", "white", "black", "brown", "grey", "wooden", "striped")
POSITIVE_ADJECTIVES = (
    "happy", "bright", "kind", "lovely", "warm", "gentle", "cheerful", "friendly",
    "beautiful", "sweet", "calm", "brave", "clever", "fresh", "wonderful", "pleasant",
)  # fmt: skip
NEGATIVE_ADJECTIVES = (
    "sad", "dark", "cold", "broken", "angry", "cruel", "gloomy", "dirty",
    "ugly", "rotten", "lonely", "bitter", "scary", "awful", "nasty", "grim",
)  # fmt: skip
NEUTRAL_TRANSITIVE = (
    "found", "saw", "carried", "took", "opened", "watched", "painted", "followed", "brought",
    "held", "moved", "pushed", "met", "visited", "washed", "counted", "picked", "chose",
)  # fmt: skip
POSITIVE_TRANSITIVE = ("loved", "helped", "hugged", "praised", "enjoyed", "thanked", "admired", "welcomed")
NEGATIVE_TRANSITIVE = ("hated", "hurt", "ruined", "feared", "blamed", "kicked", "scolded", "stole")
NEUTRAL_INTRANSITIVE = ("walked", "ran", "slept", "waited", "sat", "stood", "worked", "swam", "rested", "stayed")
POSITIVE_INTRANSITIVE = ("smiled", "laughed", "danced", "sang", "cheered", "played")
NEGATIVE_INTRANSITIVE = ("cried", "screamed", "sulked", "complained", "shivered", "trembled")
NEUTRAL_ADVERBS = ("slowly", "quickly", "quietly", "again", "today", "yesterday", "early", "late")
POSITIVE_ADVERBS = ("happily", "gladly", "warmly", "kindly", "joyfully", "sweetly")
NEGATIVE_ADVERBS = ("sadly", "angrily", "badly", "bitterly", "coldly", "miserably")
PREPOSITIONS = ("near", "under", "behind", "beside", "in", "on", "across", "by", "past", "over", "through", "at")
COPULAS = ("was", "looked", "felt", "seemed")
REPORTING_VERBS = ("said", "thought", "knew")
OTHER_WORDS = ("an", "and", "were", "very", "that", "it", "day", ".")

POSITIVE_WORDS = frozenset(POSITIVE_ADJECTIVES + POSITIVE_TRANSITIVE + POSITIVE_INTRANSITIVE + POSITIVE_ADVERBS)
NEGATIVE_WORDS = frozenset(NEGATIVE_ADJECTIVES + NEGATIVE_TRANSITIVE + NEGATIVE_INTRANSITIVE + NEGATIVE_ADVERBS)
FUNCTION_WORDS = frozenset(
    DETERMINERS + SUBJECT_PRONOUNS + OBJECT_PRONOUNS + PREPOSITIONS + COPULAS + REPORTING_VERBS + OTHER_WORDS
)
"""Words that repeat in ordinary sentences ("the dog saw the cat"); :mod:`demo.gold` lets them repeat."""

_WORD_GROUPS = {
    "determiner": DETERMINERS,
    "subject_pronoun": SUBJECT_PRONOUNS,
    "object_pronoun": OBJECT_PRONOUNS,
    "name": NAMES,
    "animal": ANIMAL_NOUNS,
    "person": PEOPLE_NOUNS,
    "thing": THING_NOUNS,
    "place": PLACE_NOUNS,
    "neutral_adjective": NEUTRAL_ADJECTIVES,
    "colour": COLOUR_ADJECTIVES,
    "positive_adjective": POSITIVE_ADJECTIVES,
    "negative_adjective": NEGATIVE_ADJECTIVES,
    "neutral_transitive": NEUTRAL_TRANSITIVE,
    "positive_transitive": POSITIVE_TRANSITIVE,
    "negative_transitive": NEGATIVE_TRANSITIVE,
    "neutral_intransitive": NEUTRAL_INTRANSITIVE,
    "positive_intransitive": POSITIVE_INTRANSITIVE,
    "negative_intransitive": NEGATIVE_INTRANSITIVE,
    "neutral_adverb": NEUTRAL_ADVERBS,
    "positive_adverb": POSITIVE_ADVERBS,
    "negative_adverb": NEGATIVE_ADVERBS,
    "preposition": PREPOSITIONS,
    "copula": COPULAS,
    "reporting_verb": REPORTING_VERBS,
    "other": OTHER_WORDS,
}
VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(word for words in _WORD_GROUPS.values() for word in words))
"""Every word the grammar can produce, once each, in a fixed order (the tokenizer's id order)."""


def _word_classes() -> dict[str, str]:
    """A word's group name, or the word itself when it is in several groups ("her", "that", "it") or in "other"."""
    groups: dict[str, list[str]] = {}
    for group, words in _WORD_GROUPS.items():
        for word in words:
            groups.setdefault(word, []).append(group)
    return {word: names[0] if names != ["other"] and len(names) == 1 else word for word, names in groups.items()}


WORD_CLASSES = _word_classes()
"""Word -> class: the unit of :func:`grammatical_bigrams` (e.g. "lovely" -> "positive_adjective")."""

MIN_WORDS, MAX_WORDS = 5, 14
MIN_PROMPT_WORDS, MAX_PROMPT_WORDS = 2, 4
MIN_RESPONSE_WORDS = 2
_VOWELS = frozenset("aeiou")


def _pick(
    rng: random.Random,
    positive: tuple[str, ...],
    negative: tuple[str, ...],
    neutral: tuple[str, ...],
    *,
    p_sentiment: float,
) -> str:
    """One word for a sentiment slot: positive or negative each with probability ``p_sentiment / 2``."""
    draw = rng.random()
    if draw < p_sentiment / 2:
        return rng.choice(positive)
    if draw < p_sentiment:
        return rng.choice(negative)
    return rng.choice(neutral)


def _quality_adjective(rng: random.Random, *, p_sentiment: float = 0.7) -> str:
    return _pick(rng, POSITIVE_ADJECTIVES, NEGATIVE_ADJECTIVES, NEUTRAL_ADJECTIVES, p_sentiment=p_sentiment)


def _determiner(rng: random.Random) -> str:
    """``the`` about half the time, ``a`` a quarter, the others share the rest."""
    draw = rng.random()
    if draw < 0.45:
        return "the"
    return "a" if draw < 0.7 else rng.choice(DETERMINERS[2:])


def _noun_phrase(rng: random.Random, nouns: tuple[str, ...], *, p_adjective: float, p_colour: float) -> list[str]:
    """Determiner, optional quality adjective, optional colour (never for people), noun."""
    noun = rng.choice(nouns)
    words = [_determiner(rng)]
    if rng.random() < p_adjective:
        words.append(_quality_adjective(rng))
    if noun not in PEOPLE_NOUNS and rng.random() < p_colour:
        words.append(rng.choice(COLOUR_ADJECTIVES))
    return [*words, noun]


def _subject(rng: random.Random) -> list[str]:
    draw = rng.random()
    if draw < 0.25:
        return [rng.choice(SUBJECT_PRONOUNS)]
    if draw < 0.4:
        return [rng.choice(NAMES)]
    return _noun_phrase(rng, ANIMAL_NOUNS + PEOPLE_NOUNS, p_adjective=0.6, p_colour=0.2)


def _object(rng: random.Random) -> list[str]:
    draw = rng.random()
    if draw < 0.15:
        return [rng.choice(OBJECT_PRONOUNS)]
    if draw < 0.25:
        return [rng.choice(NAMES)]
    nouns = THING_NOUNS if rng.random() < 0.75 else ANIMAL_NOUNS + PEOPLE_NOUNS
    return _noun_phrase(rng, nouns, p_adjective=0.7, p_colour=0.3)


def _place(rng: random.Random) -> list[str]:
    return [rng.choice(PREPOSITIONS), *_noun_phrase(rng, PLACE_NOUNS, p_adjective=0.4, p_colour=0.0)]


def _adverb(rng: random.Random) -> str:
    return _pick(rng, POSITIVE_ADVERBS, NEGATIVE_ADVERBS, NEUTRAL_ADVERBS, p_sentiment=0.7)


def _copula(rng: random.Random, subject: list[str]) -> str:
    verb = rng.choice(COPULAS)
    return "were" if verb == "was" and subject[-1] in PLURAL_SUBJECTS else verb


def _predicate_adjectives(rng: random.Random) -> list[str]:
    words = ["very"] if rng.random() < 0.3 else []
    words.append(_quality_adjective(rng, p_sentiment=0.8))
    if rng.random() < 0.3:
        words += ["and", _quality_adjective(rng, p_sentiment=0.8)]
    return words


def _template_words(rng: random.Random) -> list[str]:
    """One sentence from a template chosen by weight (before the a/an fix and the length check)."""
    draw = rng.random()
    if draw < 0.35:
        verb = _pick(rng, POSITIVE_TRANSITIVE, NEGATIVE_TRANSITIVE, NEUTRAL_TRANSITIVE, p_sentiment=0.5)
        words = [*_subject(rng), verb, *_object(rng)]
        words += _place(rng) if rng.random() < 0.5 else []
        words += [_adverb(rng)] if rng.random() < 0.4 else []
    elif draw < 0.55:
        verb = _pick(rng, POSITIVE_INTRANSITIVE, NEGATIVE_INTRANSITIVE, NEUTRAL_INTRANSITIVE, p_sentiment=0.5)
        words = [*_subject(rng), verb]
        words += [_adverb(rng)] if rng.random() < 0.6 else []
        words += _place(rng) if rng.random() < 0.6 else []
    elif draw < 0.75:
        subject = _subject(rng)
        words = [*subject, _copula(rng, subject), *_predicate_adjectives(rng)]
        words += _place(rng) if rng.random() < 0.3 else []
    elif draw < 0.85:
        words = ["it", "was", "a"]
        words += ["very"] if rng.random() < 0.3 else []
        words += [_quality_adjective(rng, p_sentiment=0.8), "day"]
        words += _place(rng) if rng.random() < 0.5 else []
    else:
        subject = _noun_phrase(rng, THING_NOUNS + ANIMAL_NOUNS, p_adjective=0.3, p_colour=0.0)
        words = [*_subject(rng), rng.choice(REPORTING_VERBS), "that", *subject, "was", *_predicate_adjectives(rng)]
    return [*words, "."]


def _fix_articles(words: list[str]) -> list[str]:
    """``a`` becomes ``an`` before a vowel ("an old dog")."""
    return [
        "an" if word == "a" and following[0] in _VOWELS else word
        for word, following in zip(words, [*words[1:], "."], strict=True)
    ]


def generate_sentence(rng: random.Random) -> str:
    """One sentence of 5-14 words (``.`` included), words separated by single spaces.

    Args:
        rng: the random stream; the sentence depends only on its state.

    Returns:
        e.g. ``"the old dog found a bright red ball near the river ."``.
    """
    while True:
        words = _fix_articles(_template_words(rng))
        if MIN_WORDS <= len(words) <= MAX_WORDS:
            return " ".join(words)


def generate_corpus(num_sentences: int, *, seed: int) -> list[str]:
    """``num_sentences`` sentences, the same ones for the same seed.

    Args:
        num_sentences: how many sentences (duplicates are kept: they are the grammar's frequencies).
        seed: seed of the random stream.

    Returns:
        The sentences in generation order.
    """
    if num_sentences < 0:
        raise ValueError(f"`num_sentences` must be non-negative, got {num_sentences}")
    rng = random.Random(f"corpus:{seed}")
    return [generate_sentence(rng) for _ in range(num_sentences)]


def generate_prompts(num_train: int, num_eval: int, *, seed: int) -> tuple[list[str], list[str]]:
    """Distinct sentence beginnings (2-4 words), split into disjoint train and eval sets.

    Each prompt is the start of a fresh sentence and leaves it at least two words to complete.

    Args:
        num_train: train prompts wanted.
        num_eval: held-out eval prompts wanted.
        seed: seed of the random stream (separate from the corpus stream of the same seed).

    Returns:
        ``(train, eval)`` lists of prompts such as ``"the old dog"``; no string is in both.
    """
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"`num_train` and `num_eval` must be non-negative, got {num_train} and {num_eval}")
    rng = random.Random(f"prompts:{seed}")
    prompts: dict[str, None] = {}
    while len(prompts) < num_train + num_eval:
        words = generate_sentence(rng).split()
        longest = min(MAX_PROMPT_WORDS, len(words) - MIN_RESPONSE_WORDS)
        prompts[" ".join(words[: rng.randint(MIN_PROMPT_WORDS, longest)])] = None
    ordered = list(prompts)
    rng.shuffle(ordered)
    return ordered[num_eval:], ordered[:num_eval]


GRAMMAR_SAMPLE_SIZE = 50_000
"""Sentences sampled to list the grammar's class bigrams; a test checks ten times more find no new one."""


@functools.cache
def grammatical_bigrams(sample_size: int = GRAMMAR_SAMPLE_SIZE) -> frozenset[tuple[str, str]]:
    """The pairs of adjacent word classes (:data:`WORD_CLASSES`) that the grammar produces.

    Sampled rather than derived from the templates, so it cannot drift from :func:`generate_sentence`;
    about 0.2 s, once per process.

    Args:
        sample_size: sentences to sample (from a fixed seed).

    Returns:
        e.g. ``("determiner", "positive_adjective")`` is in the set, ``("positive_adjective",
        "positive_adjective")`` is not (the grammar joins two quality adjectives with "and").
    """
    rng = random.Random("grammar")
    bigrams = set()
    for _ in range(sample_size):
        classes = [WORD_CLASSES[word] for word in generate_sentence(rng).split()]
        bigrams.update(zip(classes, classes[1:], strict=False))
    return frozenset(bigrams)
