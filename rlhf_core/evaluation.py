"""Evaluation maths: how a policy compares with the reference on held-out prompts.

Choices:
1. KL to the reference is measured per response as the sum over its action tokens of a per-token
   estimator of :func:`rlhf_core.rewards.kl_estimate` (k1 by default, the estimate TRL and
   OpenRLHF report), then averaged over responses. k1 is unbiased but can be negative on a
   finite sample; k3 never is.
2. A win rate compares two responses to the same prompt by a judge's score; a tie counts half
   (as in AlpacaEval's length-uncontrolled win rate).
3. A :class:`Judge` is whatever scores text: the embedded demo's hidden gold rubric, a person's
   rubric, a programmatic checker. The pipeline reaches one through its ``module:attribute``
   name, so nothing here depends on a particular judge.
4. A learned reward drifts to the length of responses first (Singhal et al. 2023, "A long way to go"): the
   Pearson correlation of scores with response lengths (:func:`correlation`) is reported every iteration.
5. An episode's turn **succeeds** when its reward is > 0 (:func:`episode_success`): the environment's own
   judgement, whatever else it scores (a penalty, a partial 0). Success by turn n is having succeeded at one of
   the first n turns; recovery, succeeding later after a first turn that did not.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from rlhf_core.rewards import KLEstimator, kl_estimate


class Judge(Protocol):
    """A rater that scores a response to a prompt, and prefers one of two responses."""

    def score(self, prompt: str, response: str) -> float:
        """How good ``response`` is as an answer to ``prompt`` (higher is better)."""
        ...

    def prefers(self, prompt: str, first: str, second: str) -> tuple[int, float]:
        """``(0, margin)`` when ``first`` is better, ``(1, margin)`` when ``second`` is; margin >= 0."""
        ...


@torch.no_grad()
def response_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """KL(policy || reference) of each response: the per-token estimate summed over its actions.

    Naive equivalent: ``[sum(kl_estimate(lp[b], ref[b])[action_mask[b]]) for b in range(B)]``.

    Shapes:
        logprobs, ref_logprobs, action_mask: (B, R); returns (B,).
    """
    per_token = kl_estimate(logprobs, ref_logprobs, estimator=estimator)  # (B, R)
    return torch.where(action_mask.bool(), per_token, torch.zeros_like(per_token)).sum(dim=1)  # (B,)


@torch.no_grad()
def win_rate(scores: torch.Tensor, baseline_scores: torch.Tensor) -> torch.Tensor:
    """Share of rows where ``scores`` beats ``baseline_scores``; a tie counts half.

    Naive equivalent: ``mean([1.0 if s > b else 0.5 if s == b else 0.0 for s, b in zip(scores, baseline)])``.

    Shapes:
        scores, baseline_scores: (B,); returns ().
    """
    if scores.shape != baseline_scores.shape or scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(
            f"`scores` {tuple(scores.shape)} and `baseline_scores` {tuple(baseline_scores.shape)} must be equal, "
            "non-empty 1-D shapes"
        )
    wins = (scores > baseline_scores).double() + 0.5 * (scores == baseline_scores).double()  # (B,)
    return wins.mean()


@torch.no_grad()
def correlation(values: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """The Pearson correlation of ``values`` with ``others`` (e.g. reward-model scores with response lengths); 0 when
    either is constant, where it is undefined.

    Naive equivalent: ``cov(x, y) / (std(x) * std(y))`` over the rows, in float64.

    Shapes:
        values, others: (B,); returns ().
    """
    if values.shape != others.shape or values.dim() != 1:
        raise ValueError(f"`values` {tuple(values.shape)} and `others` {tuple(others.shape)} must be equal 1-D shapes")
    x, y = values.double() - values.double().mean(), others.double() - others.double().mean()  # (B,), (B,)
    scale = (x.square().sum() * y.square().sum()).sqrt()
    return torch.where(scale > 0, (x * y).sum() / scale.clamp_min(1e-300), torch.zeros((), dtype=torch.float64))


class EpisodeSuccess(NamedTuple):
    """How episodes succeeded turn by turn (choice 5)."""

    by_turn: torch.Tensor
    """(N,): the share of episodes that succeeded at one of their first n + 1 turns (the last: at any turn)."""
    recovered: torch.Tensor
    """(): of the episodes whose first turn was played and did not succeed, the share that succeeded at a later one;
    NaN when there is none."""


@torch.no_grad()
def episode_success(turn_rewards: torch.Tensor, turns: torch.Tensor) -> EpisodeSuccess:
    """Success by turn and recovery of B episodes (choice 5); the values past an episode's ``turns`` are ignored.

    Naive equivalent: ``by_turn[n] = mean([any(r > 0 for r in rewards[b][: min(n + 1, turns[b])]) for b])``;
    ``recovered = mean([any(r > 0 for r in rewards[b][1 : turns[b]]) for b if turns[b] > 0 and rewards[b][0] <= 0])``.

    Shapes:
        turn_rewards: (B, N), each episode's reward of each model turn; turns: (B,), how many it played (0 to N).
    """
    played = torch.arange(turn_rewards.shape[1], device=turn_rewards.device) < turns[:, None]  # (B, N)
    succeeded = (turn_rewards > 0) & played  # (B, N)
    so_far = succeeded.cumsum(dim=1) > 0  # (B, N): succeeded at one of the first n + 1 turns
    failed_first = played[:, 0] & ~succeeded[:, 0]  # (B,)
    return EpisodeSuccess(so_far.double().mean(dim=0), so_far[failed_first, -1].double().mean())
