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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import combinations

from rlhf_core.config import Pairing
from tasks.labelers import Label


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
