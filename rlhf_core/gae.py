"""Generalised advantage estimation over the action window.

Choices:
1. Each response is one episode that ends after its last action token: the value after it is 0.
2. Rewards and values at masked (padding) positions are replaced by 0 first, so whatever sits
   there (even inf or nan) never changes advantages or returns (a tested invariant).
3. ``returns = advantages + values`` (the lambda-return), the critic's regression target.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Advantages(NamedTuple):
    """GAE output: both (B, R), 0 outside the action mask."""

    advantages: torch.Tensor
    returns: torch.Tensor


@torch.no_grad()
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> Advantages:
    """Advantages ``A_t = sum_l (gamma * lambda)^l * delta_{t+l}``, ``delta_t = r_t + gamma V_{t+1} - V_t``.

    Naive equivalent (one row, ``n`` valid tokens)::

        last = 0
        for t in reversed(range(n)):
            next_value = values[t + 1] if t + 1 < n else 0.0
            delta = rewards[t] + gamma * next_value - values[t]
            last = delta + gamma * gae_lambda * last
            advantages[t] = last

    Args:
        rewards: per-token rewards (see :func:`rlhf_core.rewards.shaped_rewards`).
        values: critic values of the state before each action token (rollout time).
        action_mask: prefix mask of valid action tokens.
        gamma: discount.
        gae_lambda: GAE lambda.

    Shapes:
        rewards, values, action_mask: (B, R); returns two (B, R).

    References:
        Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16;
        TRL ``PPOTrainer`` (v0.11) advantage loop.
    """
    if not (rewards.shape == values.shape == action_mask.shape):
        raise ValueError(
            f"`rewards`, `values` and `action_mask` must share a shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(action_mask.shape)}"
        )
    mask = action_mask.to(values.dtype)
    # Selected, not multiplied by the mask, so even inf or nan padding cannot leak in.
    values = torch.where(action_mask.bool(), values, torch.zeros_like(values))  # (B, R)
    rewards = torch.where(action_mask.bool(), rewards, torch.zeros_like(rewards))  # (B, R)
    response_length = rewards.shape[1]
    advantages_reversed = []
    last_advantage = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(response_length)):
        next_value = values[:, t + 1] if t + 1 < response_length else torch.zeros_like(values[:, 0])
        next_is_valid = mask[:, t + 1] if t + 1 < response_length else torch.zeros_like(mask[:, 0])
        delta = rewards[:, t] + gamma * next_value * next_is_valid - values[:, t]
        last_advantage = (delta + gamma * gae_lambda * last_advantage * next_is_valid) * mask[:, t]
        advantages_reversed.append(last_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, R)
    returns = (advantages + values) * mask  # (B, R)
    return Advantages(advantages=advantages, returns=returns)
