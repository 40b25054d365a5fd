"""Which of a prompt's N candidates become preference pairs (the setting ``pairing``).

A labeler compares pairs of candidates; the pairing says which pairs it is shown and which of its answers are
kept. With a rubric that scores most answers alike, most consecutive pairs tie, and a tie teaches the reward model
nothing true (it is stored with margin 0 and trained on as "first beats second"); comparing every pair of the
prompt's candidates finds the decisive ones.

Choices:
1. ``consecutive`` (the default, the pairs every campaign recorded before it existed): candidates (0, 1), (2, 3),
   ... of each prompt, each pair kept as labelled, ties included.
2. ``best_vs_worse``: UltraFeedback's binarised pairs (Cui et al. 2023; HuggingFaceH4/ultrafeedback_binarized):
   every pair of the prompt's candidates is compared, the best candidate (one no other beats; the first of several)
   is chosen and one of the candidates it beats, drawn at random, rejected. One pair per prompt, none where the
   candidates all tie.
3. ``all_decisive``: every pair of the prompt's candidates with a winner (margin > 0), N(N-1)/2 at most; ties
   are dropped. More pairs per second of sampling, but pairs of one prompt share candidates, so they are not
   independent evidence.
4. Only labelers that score each candidate alone may compare every pair (:data:`rlhf_core.config.SCORING_LABELERS`):
   their answers are consistent (transitive), and N(N-1)/2 comparisons cost N scores' worth of work. A person
   (``human``) is asked about consecutive pairs only.
5. ``asking.select`` (:func:`asked_pairs`) asks the labeler about only a budget of the compared pairs, before any
   is labelled, so a labeler that costs (a person) is paid for those alone: the held-out share drawn at random, the
   rest the pairs the previous reward model is least sure of (``uncertain``) or drawn at random too (``random``, and
   ``uncertain`` in iteration 0, which has no reward model).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import combinations
from typing import Any, NamedTuple

from rlhf_core.config import Pairing
from tasks.labelers import CandidatePair, Label


def compared_pairs(candidates: int, pairing: Pairing) -> list[tuple[int, int]]:
    """The candidate index pairs of one prompt that the labeler compares, in order.

    >>> compared_pairs(4, "consecutive"), compared_pairs(3, "all_decisive")
    ([(0, 1), (2, 3)], [(0, 1), (0, 2), (1, 2)])

    Raises:
        ValueError: ``consecutive`` with an odd number of candidates.
    """
    if pairing == "consecutive":
        if candidates % 2:
            raise ValueError(f"consecutive pairs need an even number of candidates, got {candidates}")
        return [(index, index + 1) for index in range(0, candidates, 2)]
    return list(combinations(range(candidates), 2))


def kept_pairs(
    compared: Sequence[tuple[int, int]], labels: Sequence[Label], pairing: Pairing, *, rng: random.Random
) -> list[int]:
    """The indices into ``compared`` (one prompt's pairs, labelled by ``labels``) that become preference pairs.

    Args:
        compared: :func:`compared_pairs` of the prompt.
        labels: the labeler's answer for each compared pair (``winner`` 0 is the pair's first candidate).
        pairing: the module's choices 1-3.
        rng: draws the rejected candidate of ``best_vs_worse``.

    Returns:
        Indices in increasing order, except ``best_vs_worse``'s single one.
    """
    if pairing == "consecutive":
        return list(range(len(compared)))
    decisive = [index for index, label in enumerate(labels) if label.margin > 0]
    if pairing == "all_decisive":
        return decisive
    beaten = {compared[index][1 - labels[index].winner] for index in decisive}
    unbeaten = sorted({candidate for pair in compared for candidate in pair} - beaten)
    if not unbeaten or not decisive:  # all tie (or, for an inconsistent labeler, every candidate is beaten)
        return []
    best = unbeaten[0]
    wins = [index for index in decisive if compared[index][labels[index].winner] == best]
    return [rng.choice(wins)] if wins else []


HELD_OUT_HEAD = "held_out_head"
"""The metric of a ``preferences`` output whose pairs were asked about by ``asking.select``: how many of its first
rows are the pairs drawn at random to be held out (:func:`rlhf_core.reward_training.arrival_split`)."""


def held_out_head(output: Any) -> int | None:
    """How many of the first rows of a ``preferences`` output (or answers of a ``human_labels`` one) are pairs drawn
    at random to be held out, where its pairs were asked about by ``asking.select``; None where every compared pair
    was (:data:`HELD_OUT_HEAD`)."""
    head = output.metrics.get(HELD_OUT_HEAD)
    return None if head is None else round(head)


class AskedPairs(NamedTuple):
    """The compared pairs a labeler is asked about (indices into them, each part in increasing order)."""

    held_out: list[int]
    """Drawn at random: the reward model's held-out pairs (:func:`rlhf_core.reward_training.arrival_split`)."""
    chosen: list[int]
    """The rest of the budget: the smallest reward-model margins, or drawn at random without margins."""


def asked_pairs(compared: int, margins: Sequence[float] | None, *, budget: int, held_out: int, seed: int) -> AskedPairs:
    """Which of ``compared`` pairs a labeler is asked about: ``held_out`` of them drawn at random, then the
    ``budget - held_out`` others with the smallest ``margins`` (ties in the order drawn), or drawn at random where
    ``margins`` is None. Every pair when ``budget`` is at least ``compared``.

    The held-out pairs are drawn before any margin is looked at: a held-out set chosen by margin would measure the
    reward model on the pairs it finds hardest, not on the pairs it will score.

    Reference (the same, naively)::

        order = list(range(compared)); random.Random(seed).shuffle(order)
        rest = order[held_out:] if margins is None else sorted(order[held_out:], key=margins.__getitem__)
        held_out, chosen = sorted(order[:held_out]), sorted(rest[: budget - held_out])

    Args:
        compared: how many pairs were compared (all prompts' :func:`compared_pairs`, in prompt order).
        margins: the previous reward model's ``|score(first) - score(second)|`` of each pair, or None.
        budget: pairs to ask about.
        held_out: how many of them are drawn at random for the held-out set (at most ``budget``).
        seed: draws the held-out pairs and orders the rest (the tie-break of equal margins).

    Raises:
        ValueError: ``margins`` is not one per pair, or ``held_out`` exceeds ``budget``.
    """
    if margins is not None and len(margins) != compared:
        raise ValueError(f"`margins` holds {len(margins)} values for {compared} compared pairs")
    if held_out > budget:
        raise ValueError(f"`held_out` {held_out} exceeds `budget` {budget}")
    order = list(range(compared))
    random.Random(seed).shuffle(order)
    drawn, rest = order[:held_out], order[held_out:]
    if margins is not None:
        rest = sorted(rest, key=lambda index: margins[index])  # a stable sort: equal margins stay in the order drawn
    return AskedPairs(sorted(drawn), sorted(rest[: max(budget - held_out, 0)]))


def askable_pairs(pairs: Sequence[CandidatePair]) -> list[int]:
    """The indices of the ``pairs`` a labeler may be asked about: all but a pair of two identical responses, which
    no labeler can prefer either of, and which a reward model is least sure of (its margin is 0)."""
    return [index for index, pair in enumerate(pairs) if pair.first_ids != pair.second_ids]
