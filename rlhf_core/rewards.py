"""Per-token rewards: KL estimators and the shaped reward of RLHF-PPO.

Choices:
1. ``d = logprobs - ref_logprobs`` per sampled token; k1 = d, k2 = d^2 / 2,
   k3 = exp(-d) - 1 + d (Schulman, "Approximating KL divergence", 2020).
2. The sequence score lands on the last action token (the EOS, or the last generated token
   when the response was truncated), as in Ziegler et al. 2019 and TRL's PPOTrainer.
3. The per-token reward is ``-kl_coef * kl_t`` everywhere in the action window, plus the score
   on the last token. Outside the action window it is 0, whatever (even inf or nan) sits there.
4. Scores may be normalised by the reward model's held-out statistics or by running ones over every rollout so
   far (:func:`update_moments`), kept as count, mean and M2 so that merging is exact.
5. A critic started from a reward model predicts the normalised score, not the raw one: the normalisation is folded
   into its head (:func:`fold_normalisation`). OpenRLHF normalises the critic's outputs by the reward model's mean and
   std at every forward; folded, the critic stays an ordinary linear head that training moves freely.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rlhf_core.config import KLEstimator


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-log_ratio) + log_ratio


_KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: KLEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    Args:
        logprobs: log pi(a_t | s_t) of the policy that sampled the tokens.
        ref_logprobs: log pi_ref(a_t | s_t) of the frozen reference.
        estimator: ``"k1"`` (unbiased, can be negative), ``"k2"`` (biased, low variance) or
            ``"k3"`` (unbiased, non-negative).

    Shapes:
        logprobs, ref_logprobs: (B, R); returns (B, R).

    References:
        http://joschu.net/blog/kl-approx.html
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {sorted(_KL_ESTIMATORS)}, got {estimator!r}")
    return _KL_ESTIMATORS[estimator](logprobs - ref_logprobs)


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True in each row; rows with no action give 0.

    Any mask, not only a prefix one: an episode's mask has gaps at the environment's tokens
    (:mod:`rlhf_core.episodes`), and its last action is then not at ``sum - 1``. On a prefix mask the
    two agree.

    Naive equivalent: ``max(t for t in range(R) if action_mask[b, t])`` (0 for an empty row).

    Shapes:
        action_mask: (B, R); returns (B,) long.
    """
    positions = torch.arange(action_mask.shape[1], device=action_mask.device)  # (R,)
    return torch.where(action_mask.bool(), positions, -1).amax(dim=1).clamp(min=0)  # (B,)


class ShapedRewards(NamedTuple):
    """The per-token reward and the KL term it was built from. Both (B, R), 0 outside the mask."""

    rewards: torch.Tensor
    kl: torch.Tensor


@torch.no_grad()
def shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = "k1",
    score_clip: float | None = None,
) -> ShapedRewards:
    """Per-token rewards ``r_t = -kl_coef * kl_t + [t == last] * score``.

    Naive equivalent::

        for b in range(B):
            last = action_mask[b].sum() - 1
            for t in range(R):
                if action_mask[b, t]:
                    rewards[b, t] = -kl_coef * kl[b, t] + (scores[b] if t == last else 0)

    Args:
        scores: sequence scores from the reward model (already normalised if wanted).
        logprobs, ref_logprobs: sampled tokens' log-probs under policy and reference.
        action_mask: True for generated tokens up to and including EOS.
        kl_coef: weight of the KL penalty (beta).
        estimator: KL estimator, see :func:`kl_estimate`.
        score_clip: if set, scores are clipped to ``[-score_clip, score_clip]`` first.

    Shapes:
        scores: (B,); logprobs, ref_logprobs, action_mask: (B, R); returns two (B, R).
    """
    if scores.dim() != 1 or scores.shape[0] != action_mask.shape[0]:
        raise ValueError(f"`scores` must have shape ({action_mask.shape[0]},), got {tuple(scores.shape)}")
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    # Selected, not multiplied by the mask: padding log-probs far apart make k3 overflow to inf there.
    kl = kl_estimate(logprobs, ref_logprobs, estimator=estimator)  # (B, R)
    kl = torch.where(action_mask.bool(), kl, torch.zeros_like(kl))  # (B, R)
    rewards = -kl_coef * kl  # (B, R)
    has_action = action_mask.any(dim=1).to(logprobs.dtype)  # (B,)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards = rewards.index_put(
        (rows, last_action_index(action_mask)), scores.to(rewards.dtype) * has_action, accumulate=True
    )
    return ShapedRewards(rewards=rewards, kl=kl)


def normalize_scores(scores: torch.Tensor, *, mean: float, std: float, eps: float = 1e-8) -> torch.Tensor:
    """``(scores - mean) / std``, with the mean and std of the reward model's held-out scores, or the running ones of
    every rollout's (:func:`update_moments`).

    Shapes:
        scores: (B,); returns (B,).
    """
    return (scores - mean) / (std + eps)


@torch.no_grad()
def fold_normalisation(head: torch.nn.Linear, *, mean: float, std: float, eps: float = 1e-8) -> None:
    """Make the score head ``w . h + b`` output :func:`normalize_scores` of its score, ``(w . h + b - mean) / (std +
    eps)``, in place: weight ``w / (std + eps)``, bias ``(b - mean) / (std + eps)`` (choice 5).

    Shapes:
        head: a Linear of H inputs and 1 output, with a bias.
    """
    if head.bias is None or head.out_features != 1:
        raise ValueError(f"a score head is a Linear with one output and a bias, got {head}")
    scale = std + eps
    head.weight.div_(scale)
    head.bias.sub_(mean).div_(scale)


class ScoreMoments(NamedTuple):
    """The count, mean and sum of squared deviations from the mean (M2) of every score seen so far."""

    count: int
    mean: float
    m2: float

    @property
    def std(self) -> float:
        """The unbiased standard deviation (1.0 for fewer than two scores, which leave it unknown)."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0


@torch.no_grad()
def update_moments(moments: ScoreMoments | None, scores: torch.Tensor) -> ScoreMoments:
    """``moments`` with ``scores`` added: the running statistics of TRL's ``use_score_scaling`` (``RunningMoments``),
    merged exactly (Chan, Golub and LeVeque 1979), so a run resumed from the carried moments equals one that never
    stopped.

    Naive equivalent: the count, mean and ``((x - mean) ** 2).sum()`` of every score so far, concatenated.

    Shapes:
        scores: (B,).
    """
    batch = scores.double()
    count, mean = batch.numel(), float(batch.mean())
    m2 = float((batch - mean).square().sum())
    if moments is None or moments.count == 0:
        return ScoreMoments(count, mean, m2)
    total = moments.count + count
    delta = mean - moments.mean
    return ScoreMoments(
        total, moments.mean + delta * count / total, moments.m2 + m2 + delta * delta * moments.count * count / total
    )
