"""Reward functions the flow tests name as ``reward.function`` (``tests.flows.rewards:...``)."""

from __future__ import annotations


def length_score(prompt: str, response: str) -> float:
    """A verifiable reward of sorts: longer responses score higher (the tests only need a finite number)."""
    return 0.1 * len(response.split())


def not_finite(prompt: str, response: str) -> float:
    """A broken reward function: the stage must fail with the prompt's id, not train on a NaN."""
    return float("nan")
