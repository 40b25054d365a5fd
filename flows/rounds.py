"""An iteration's rounds of candidates and labels: with ``sizes.decisive_pairs``, an iteration that labelled fewer
decisive pairs (pairs with a winner) than asked samples and labels another round of fresh prompts, up to
``sizes.max_rounds`` rounds; its pairs are the union of its rounds'.

Choices:

1. A new round takes fresh prompts (the next block of the rotation, :func:`tasks.text.round_prompts`),
   not more candidates for the prompts whose candidates all tied: on a sparse task, fresh prompts gave 2.3x more
   prompts with a winner per sampled token (bench/RESULTS.md, "More candidates for tied prompts, or fresh
   prompts").
2. Each round is a ``sample_candidates`` and a ``collect_preferences`` output of its own, keyed by the earlier rounds'
   outputs: a crashed iteration resumes at its first unfinished round, a rerun reuses the finished ones, and the first
   round is keyed, seeded and given its prompts as an iteration of one round (no ``sizes.decisive_pairs``) is.
3. A budget that ends short is said (on the console, and ``rounds/short`` 1), not refused: the reward model refuses
   only what it cannot train on (no pair to hold out, or none to train on), and later iterations add theirs.
4. Every iteration that labels candidates records its rounds (:func:`round_metrics`), one round or several.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from campaign.config import IterationSizes
from runtime.declaration import StageResult
from tasks.settings import CollectPreferencesSettings, SampleCandidatesSettings


class Round(NamedTuple):
    """One round's outputs: its candidates (None for imported pairs, which sample none) and their labels."""

    candidates: StageResult | None
    preferences: StageResult


def round_stages(rounds: Sequence[Round]) -> list[StageResult]:
    """The stage outputs of ``rounds``, in the order they ran."""
    return [result for step in rounds for result in step if result is not None]


def decisive_pairs(rounds: Sequence[Round]) -> int:
    """The decisive pairs the ``rounds`` labelled, together."""
    return round(sum(step.preferences.metrics.get("decisive_pairs", 0.0) for step in rounds))


def wants_another_round(rounds: Sequence[Round], sizes: IterationSizes) -> bool:
    """Whether an iteration whose rounds so far are ``rounds`` samples another: ``sizes.decisive_pairs`` asks for more
    decisive pairs than they have, and ``sizes.max_rounds`` allows one more. The first round is always sampled."""
    if not rounds:
        return True
    wanted = sizes.decisive_pairs
    return wanted is not None and len(rounds) < sizes.max_rounds and decisive_pairs(rounds) < wanted


def shortfall(rounds: Sequence[Round], sizes: IterationSizes) -> str | None:
    """What to say when the budget ended before ``sizes.decisive_pairs`` (None when it did not: enough pairs, or none
    asked for)."""
    wanted, found = sizes.decisive_pairs, decisive_pairs(rounds)
    if wanted is None or found >= wanted:
        return None
    return (
        f"{found} decisive pairs of the {wanted} asked for (`sizes.decisive_pairs`) after {len(rounds)} rounds "
        f"(`sizes.max_rounds`); going on with them. Raise `sizes.max_rounds` or `sizes.preference_prompts` to label more"
    )


def round_metrics(stages: Sequence[StageResult], sizes: IterationSizes) -> dict[str, float]:
    """The iteration's rounds, from its stage outputs (``stages``): ``rounds/rounds``, ``rounds/candidates`` sampled,
    ``rounds/decisive_pairs``, ``rounds/ties``, ``rounds/pairs_per_candidate`` (decisive pairs per labelled candidate)
    and ``rounds/short`` (1 when ``sizes.decisive_pairs`` was not reached). None for an iteration that samples no
    candidates."""
    candidates = [result for result in stages if result.stage == SampleCandidatesSettings.stage]
    if not candidates:
        return {}
    preferences = [result for result in stages if result.stage == CollectPreferencesSettings.stage]
    sampled = sum(result.metrics.get("candidates", 0.0) for result in candidates)
    found = sum(result.metrics.get("decisive_pairs", 0.0) for result in preferences)
    wanted = sizes.decisive_pairs
    return {
        "rounds/rounds": float(len(candidates)),
        "rounds/candidates": sampled,
        "rounds/decisive_pairs": found,
        "rounds/ties": sum(result.metrics.get("ties", 0.0) for result in preferences),
        "rounds/pairs_per_candidate": found / max(sampled, 1.0),
        "rounds/short": float(wanted is not None and found < wanted),
    }
