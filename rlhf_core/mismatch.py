"""The training-inference mismatch: how far the sampler's log-probs are from the trainer's, and the truncated
importance weight that corrects for it.

The generation engine (vLLM, or our own decode loop in another precision) computes the log-prob of each token
it samples with its own kernels; the trainer recomputes them (``old_logprobs``) in its own numerics, and PPO's
ratio starts from those. The gap is measured, and may be corrected in the policy loss:

1. ``token_mult_prob_error``: the mean over valid tokens of ``exp(|old - engine|)``, NeMo-RL's metric
   (``nemo_rl/algorithms/loss/loss_functions.py``): 1 when both agree; NeMo-RL treats > 1.05 as a bug.
2. Truncated importance sampling (TIS; Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You
   Off-Policy RL Training"): the tokens were drawn from the engine's distribution, not the trainer's, so each
   token's loss is weighted by ``min(pi_old / pi_engine, cap) = min(exp(old - engine), cap)``, detached.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlhf_core.masked import masked_mean


class LogprobMismatch(NamedTuple):
    """The mismatch over valid tokens: the largest ``|old - engine|`` and the mean of ``exp(|old - engine|)``."""

    max_abs_diff: torch.Tensor
    token_mult_prob_error: torch.Tensor


@torch.no_grad()
def logprob_mismatch(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> LogprobMismatch:
    """How far the engine's log-probs are from the trainer's, over the valid tokens.

    Naive equivalent: ``d = [abs(o - e) for o, e, m in zip(old, engine, mask) if m]``; ``max(d)`` and
    ``sum(exp(x) for x in d) / len(d)``.

    Shapes:
        old_logprobs, engine_logprobs, action_mask: (B, R); returns two () tensors.
    """
    valid = action_mask.bool()
    difference = torch.where(valid, (old_logprobs.float() - engine_logprobs.float()).abs(), 0.0)  # (B, R)
    return LogprobMismatch(
        max_abs_diff=difference.max() if difference.numel() else torch.tensor(0.0),
        token_mult_prob_error=masked_mean(difference.exp(), valid),
    )


@torch.no_grad()
def tis_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, action_mask: torch.Tensor, *, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old - engine), cap)`` per token; 1 at padding.

    Args:
        old_logprobs: the trainer's log-probs of the sampled tokens (the behaviour PPO's ratio starts from).
        engine_logprobs: the sampler's log-probs of the same tokens.
        cap: the truncation (verl and SkyRL use 2).

    Shapes:
        old_logprobs, engine_logprobs, action_mask: (B, R); returns (B, R).
    """
    if cap <= 0:
        raise ValueError(f"`cap` must be positive, got {cap}")
    valid = action_mask.bool()
    log_ratio = torch.where(valid, old_logprobs.float() - engine_logprobs.float(), 0.0)  # (B, R)
    return torch.where(valid, log_ratio.exp().clamp(max=cap), 1.0)
