"""Reward functions the flow tests name as ``reward.function`` (``tests.flows.rewards:...``)."""

from __future__ import annotations


def length_score(prompt: str, response: str) -> float:
    """A verifiable reward of sorts: longer responses score higher (the tests only need a finite number)."""
    return 0.1 * len(response.split())


def not_finite(prompt: str, response: str) -> float:
    """A broken reward function: the stage must fail with the prompt's id, not train on a NaN."""
    return float("nan")


def names_the_answer(prompt, response: str, answer: str, topic: str) -> float:
    """The reward-function contract on a chat prompt (issue 23): the prompt arrives as its messages, the row's other
    columns as keyword arguments; 1 when the response names the reference answer."""
    if not (isinstance(prompt, list) and prompt[-1]["role"] == "user" and isinstance(topic, str)):
        raise TypeError(f"a chat prompt must arrive as its messages, got {prompt!r}")
    return float(answer.lower() in response.lower())


def says_happy(prompt: str, response: str) -> float:
    """A sparse rubric (issue 43): 1 when the response has the word "happy", which the tiny random policy says in few
    of its candidates, so most candidates of a prompt tie."""
    return float("happy" in response.split())
