"""Labelers for the preference stage: who decides which of two candidates is better.

A labeler takes candidate pairs and returns, per pair, the index of the preferred response
(0 or 1) and a margin (how much better; 0 when unknown). The pipeline has:

* ``gold``: the embedded demo's hidden programmatic rubric, playing the human;
* ``reward_model``: the current reward model as a judge;
* ``import``: no labeling at all; pairs come from a file (see the preference stage).

A human labeler (a Prefect UI form) fits the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from rlhf_core.models import RewardModel, evaluating
from tasks.text import pad_token_lists


@dataclass(frozen=True)
class CandidatePair:
    """Two responses to one prompt, as text and as full token lists (prompt + response)."""

    prompt: str
    first: str
    second: str
    first_ids: list[int]
    second_ids: list[int]


class Label(NamedTuple):
    winner: int
    margin: float


class Labeler(Protocol):
    name: str

    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]: ...


class GoldLabeler:
    """The demo's hidden gold preference (:mod:`demo.gold`)."""

    name = "gold"

    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]:
        from demo.gold import gold_prefers

        return [Label(*gold_prefers(pair.prompt, pair.first, pair.second)) for pair in pairs]


class RewardModelLabeler:
    """A reward model as judge: prefers the higher score; the margin is the score gap."""

    name = "reward_model"

    def __init__(self, model: RewardModel, *, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def label(self, pairs: Sequence[CandidatePair]) -> list[Label]:
        rows = [pair.first_ids for pair in pairs] + [pair.second_ids for pair in pairs]
        ids, mask = pad_token_lists(rows, pad_token_id=self.pad_token_id)
        with evaluating(self.model):
            scores = self.model(ids, mask)  # (2B,)
        gap = scores[: len(pairs)] - scores[len(pairs) :]  # (B,)
        return [Label(0 if value >= 0 else 1, abs(value)) for value in gap.tolist()]
