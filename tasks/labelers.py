"""Labelers for the preference stage: who decides which of two candidates is better.

A labeler takes candidate pairs and returns, per pair, the index of the preferred response
(0 or 1) and a margin (how much better; 0 when unknown). The pipeline has:

* ``gold``: a judge (the embedded demo's hidden programmatic rubric), playing the human;
* ``function``: the user's own rubric, a reward function (``reward.function``), playing the human: ``gold``
  generalised to any model and task;
* ``reward_model``: the current reward model as a judge;
* ``import``: no labeling at all; pairs come from a file (see the preference stage);
* ``human``: a person's answers on Prefect UI forms (asked by :mod:`flows.human_labels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, get_args

import torch

from rlhf_core.evaluation import Judge
from runtime.references import RewardFunction
from tasks.reward_function import score_texts
from tasks.tensors import RewardScorer
from tasks.text import Prompt


@dataclass(frozen=True)
class CandidatePair:
    """Two responses to one prompt, as text and as full token lists (prompt + response)."""

    prompt: Prompt
    first: str
    second: str
    first_ids: list[int]
    second_ids: list[int]


class Label(NamedTuple):
    winner: int
    margin: float


HumanChoice = Literal["A", "B", "tie/skip"]
"""A person's answer for one pair: response A (the first) is better, B (the second) is, or neither."""
HUMAN_CHOICES: tuple[str, ...] = get_args(HumanChoice)
SKIP = "tie/skip"


class Labeler(Protocol):
    name: str

    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]: ...


class JudgeLabeler:
    """A :class:`rlhf_core.evaluation.Judge` labels the pairs (labeler ``gold``: the hidden gold rater)."""

    name = "gold"

    def __init__(self, judge: Judge) -> None:
        self.judge = judge

    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]:
        return [Label(*self.judge.prefers(pair.prompt.text, pair.first, pair.second)) for pair in pairs]


class FunctionLabeler:
    """A reward function as the rater (labeler ``function``): prefers the candidate it scores higher; the margin
    is the score gap (0, a tie, keeps the first). It is called as a reward function is
    (:mod:`tasks.reward_function`), with the candidates' prompt and the other columns of its row (the pairs'
    prompts carry them, :func:`tasks.collect_preferences.candidate_pairs`).

    Args:
        function: the rubric, called as the rollout calls a reward function.
        function_name: its ``module:callable`` name, for error messages.
        render: the prompt as the model saw it (its chat template), for a rubric that asks for ``prompt_text``;
            None gives the prompt's readable text.
    """

    name = "function"

    def __init__(
        self, function: RewardFunction, function_name: str, *, render: Callable[[Prompt], str] | None = None
    ) -> None:
        self.function = function
        self.function_name = function_name
        self.render = render

    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]:
        prompts = [pair.prompt for pair in pairs] * 2
        responses = [pair.first for pair in pairs] + [pair.second for pair in pairs]
        rows = [f"of pair {index}" for index in range(len(pairs))] * 2  # names the pair in an error
        texts = [self.render(prompt) if self.render else prompt.text for prompt in prompts]
        scores = score_texts(self.function, self.function_name, prompts, responses, rows, prompt_texts=texts)  # (2B,)
        gap = scores[: len(pairs)] - scores[len(pairs) :]  # (B,)
        return [Label(0 if value >= 0 else 1, abs(value)) for value in gap.tolist()]


class RewardModelLabeler:
    """A reward model as judge: prefers the higher score; the margin is the score gap."""

    name = "reward_model"

    def __init__(
        self, scorer: RewardScorer, *, autocast: Callable[[], AbstractContextManager[None]] = nullcontext
    ) -> None:
        self.scorer = scorer
        self.autocast = autocast

    @torch.no_grad()
    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]:
        with self.autocast():
            scores = self.scorer.score_candidates(
                [pair.prompt for pair in pairs] * 2,
                [pair.first_ids for pair in pairs] + [pair.second_ids for pair in pairs],
                [pair.first for pair in pairs] + [pair.second for pair in pairs],
            )  # (2B,)
        gap = scores[: len(pairs)] - scores[len(pairs) :]  # (B,)
        return [Label(0 if value >= 0 else 1, abs(value)) for value in gap.tolist()]


class HumanLabeler:
    """A person's answers: ``A`` prefers the first response, ``B`` the second; the margin is 0.0.

    A person says which response is better, not by how much, so the margin is the preference
    table's "none given" value. ``tie/skip`` is no preference at all: such pairs are dropped
    before labelling (see :func:`tasks.collect_preferences.human_table`) and never reach here.

    Args:
        choices: one ``A`` or ``B`` per pair that :meth:`label` will get, in order.
    """

    name = "human"

    def __init__(self, choices: Sequence[str]) -> None:
        if not set(choices) <= {"A", "B"}:
            raise ValueError(f"`choices` must each be 'A' or 'B', got {sorted(set(choices) - {'A', 'B'})}")
        self.choices = list(choices)

    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]:
        if len(pairs) != len(self.choices):
            raise ValueError(f"got {len(pairs)} pairs for {len(self.choices)} human choices")
        return [Label(0 if choice == "A" else 1, 0.0) for choice in self.choices]
