"""Critic-free advantage estimators and the adaptive KL coefficient.

Each estimator of :data:`Estimator` but ``gae`` (:mod:`rlhf_core.gae`) works without a value model:

* ``grpo``, ``dr_grpo`` and ``rloo`` score a sequence against the other samples of its group (the
  responses to the same prompt): :func:`group_advantages`. The sequence's advantage is then the same
  at every one of its tokens (:func:`broadcast_over_tokens`), plus, when the KL penalty shapes the
  reward, the KL penalty still to come (:func:`reward_to_go`).
* ``reinforce_pp`` needs no group: the return of the KL-shaped token rewards, whitened over every
  valid token of the batch (:func:`reinforce_pp_advantages`).

Choices:
1. A group of fewer than two samples is an error, never a silent 0 or a raw score: no group
   baseline exists for it (verl falls back to mean 0 and std 1; TRL gives NaN).
2. GRPO's std is the unbiased one (Bessel-corrected), as TRL's ``GRPOTrainer`` (``nanstd``) and
   verl's ``compute_grpo_outcome_advantage`` (``torch.std``) compute it; ``eps`` is verl's 1e-6
   (TRL adds 1e-4, OpenRLHF 1e-9). A group whose samples all score the same gets advantage 0.
3. A token's advantage is its sequence's outcome advantage plus the sum of the KL penalties from
   that token on (gamma = 1), so the KL penalty acts on the tokens that caused it, as in OpenRLHF's
   ``compute_advantages_and_returns`` for its group estimators. With the KL in the loss instead,
   the penalty here is 0 and the advantage is the outcome advantage at every token.
4. Only GAE and REINFORCE++ whiten over the batch. GRPO is already normalised per group; Dr. GRPO
   and RLOO deliberately do not scale (their papers; OpenRLHF does the same).
5. Masked positions are selected away (``torch.where``), so whatever sits there never leaks in.
"""

from __future__ import annotations

import torch

from rlhf_core.config import GROUP_ESTIMATORS, Estimator
from rlhf_core.gae import Advantages
from rlhf_core.masked import masked_whiten


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, estimator: Estimator, *, eps: float = 1e-6
) -> torch.Tensor:
    """Each sequence's score against the other samples of its group (the same prompt).

    * ``grpo``: ``(r - mean_g) / (std_g + eps)``, ``std_g`` unbiased (Shao et al. 2024, DeepSeekMath,
      section 4.1.2, outcome supervision; TRL ``GRPOTrainer``, verl ``compute_grpo_outcome_advantage``).
    * ``dr_grpo``: ``r - mean_g``, no division by the std (Liu et al. 2025, "Understanding
      R1-Zero-Like Training: A Critical Perspective", Dr. GRPO).
    * ``rloo``: ``r - mean of the OTHER samples of the group`` = ``k / (k - 1) * (r - mean_g)``
      for a group of ``k`` (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
      from Human Feedback in LLMs"; Kool et al. 2019).

    Naive equivalent::

        for b in range(B):
            group = [scores[j] for j in range(B) if group_ids[j] == group_ids[b]]
            k, mean = len(group), sum(group) / len(group)
            if estimator == "rloo":
                advantages[b] = scores[b] - (sum(group) - scores[b]) / (k - 1)
            elif estimator == "dr_grpo":
                advantages[b] = scores[b] - mean
            else:
                std = (sum((r - mean) ** 2 for r in group) / (k - 1)) ** 0.5
                advantages[b] = (scores[b] - mean) / (std + eps)

    Args:
        scores: one scalar reward per sequence.
        group_ids: the group (prompt) of each sequence; any integers, in any order.
        estimator: ``grpo``, ``dr_grpo`` or ``rloo``.
        eps: added to GRPO's std, so a group of equal scores gives 0, not a division by 0.

    Shapes:
        scores: (B,); group_ids: (B,); returns (B,).

    Raises:
        ValueError: an unknown estimator, mismatched shapes, or a group with fewer than 2 samples.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {GROUP_ESTIMATORS}, got {estimator!r}")
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"`scores` and `group_ids` must be equal 1-D shapes, got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    ids, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # (G,), (B,), (G,)
    if bool((counts < 2).any()):
        lonely = int(ids[counts < 2][0])
        raise ValueError(
            f"group {lonely} has {int(counts[counts < 2][0])} sample; `{estimator}` needs at least 2 samples of "
            "every prompt (sizes.samples_per_prompt)"
        )
    # float64: k equal fp32 scores then sum exactly and divide back to themselves, so an all-equal group
    # centres to exactly 0 (in fp32 the mean can be one rounding step off, and GRPO divides that step by a
    # std of the same size: about 0.5 instead of 0 for eight copies of 7.839086532592773).
    x = scores.double()  # (B,)
    size = counts.double()[group]  # (B,)
    total = torch.zeros(len(ids), dtype=x.dtype, device=x.device).index_add(0, group, x)[group]  # (B,)
    if estimator == "rloo":
        return (x - (total - x) / (size - 1)).to(scores.dtype)
    centered = x - total / size  # (B,)
    if estimator == "dr_grpo":
        return centered.to(scores.dtype)
    squares = torch.zeros(len(ids), dtype=x.dtype, device=x.device).index_add(0, group, centered.square())
    std = (squares[group] / (size - 1)).sqrt()  # (B,)
    return (centered / (std + eps)).to(scores.dtype)


def broadcast_over_tokens(values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """One value per sequence, repeated at each of its action tokens (0 elsewhere).

    Shapes:
        values: (B,); action_mask: (B, R); returns (B, R).
    """
    if values.shape != action_mask.shape[:1]:
        raise ValueError(f"`values` must have shape ({action_mask.shape[0]},), got {tuple(values.shape)}")
    expanded = values.unsqueeze(1).expand(action_mask.shape)  # (B, R)
    return torch.where(action_mask.bool(), expanded, torch.zeros_like(expanded))


@torch.no_grad()
def reward_to_go(token_rewards: torch.Tensor, action_mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return from each token on: ``G_t = sum_{k >= t} gamma^(k - t) * r_k`` over valid tokens.

    Naive equivalent (one row, ``n`` valid tokens)::

        running = 0.0
        for t in reversed(range(n)):
            running = rewards[t] + gamma * running
            returns[t] = running

    Shapes:
        token_rewards, action_mask: (B, R); returns (B, R), 0 outside the mask.

    References:
        Williams 1992 (REINFORCE); OpenRLHF ``get_cumulative_returns``.
    """
    if token_rewards.shape != action_mask.shape:
        raise ValueError(
            f"`token_rewards` {tuple(token_rewards.shape)} and `action_mask` {tuple(action_mask.shape)} differ"
        )
    valid = action_mask.bool()
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))  # (B, R)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    returns = torch.zeros_like(rewards)  # (B, R)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(valid, returns, torch.zeros_like(returns))


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor, action_mask: torch.Tensor, *, gamma: float = 1.0
) -> Advantages:
    """REINFORCE++: the return of the KL-shaped token rewards, whitened over every valid token of the batch.

    ``returns = reward_to_go(token_rewards)``; ``advantages = (returns - mean) / std`` with the
    masked mean and unbiased masked std over all valid tokens of all rows (the project's whitening
    convention, :func:`rlhf_core.masked.masked_whiten`; OpenRLHF divides by the biased std).

    Args:
        token_rewards: shaped per-token rewards (:func:`rlhf_core.rewards.shaped_rewards`).
        action_mask: valid tokens.
        gamma: discount; REINFORCE++ uses 1.

    Shapes:
        token_rewards, action_mask: (B, R); returns two (B, R).

    References:
        Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models";
        OpenRLHF ``experience_maker.compute_advantages_and_returns`` (estimator ``reinforce``).
    """
    returns = reward_to_go(token_rewards, action_mask, gamma=gamma)  # (B, R)
    return Advantages(advantages=masked_whiten(returns, action_mask), returns=returns)


def adaptive_kl_coef(coef: float, kl: float, *, target: float, horizon: int, steps: int) -> float:
    """The next KL coefficient of the adaptive controller of Ziegler et al. 2019 (section 2.2).

    ``error = clip(kl / target - 1, -0.2, 0.2)``; ``next = coef * (1 + error * steps / horizon)``:
    the coefficient grows while the measured KL is above the target and shrinks below it, by at
    most 20% per ``horizon`` samples. A batch larger than the horizon could move it by more than
    the clipped error meant (and below 0 past 5 horizons), so ``steps`` may not exceed ``horizon``.

    Args:
        coef: the coefficient the batch was shaped with.
        kl: the KL to the reference measured on that batch (per sequence, summed over its tokens,
            averaged over sequences).
        target: the KL the controller steers to.
        horizon: how many samples the controller takes to correct by the clipped error.
        steps: samples in the batch.

    References:
        Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", section 2.2;
        TRL's and OpenRLHF's ``AdaptiveKLController``.
    """
    if target <= 0 or horizon <= 0 or not 0 <= steps <= horizon or coef < 0:
        raise ValueError(
            f"need `target` > 0, `horizon` > 0, 0 <= `steps` <= `horizon` and `coef` >= 0, got {target}, {horizon}, "
            f"{steps}, {coef}"
        )
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * steps / horizon)
