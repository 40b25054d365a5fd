"""PPO and reward-model losses, each returning ``(loss, stats)`` with stats as detached tensors.

Choices:
1. Policy loss: the clipped surrogate of Schulman et al. 2017 (eq. 7), with the optional dual
   clip of Ye et al. 2020 (eq. 5) that bounds the loss for negative advantages by ``-c * A``.
2. Value loss: ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip`` kept within
   ``value_clip_eps`` of the rollout value (the OpenAI baselines / TRL form).
3. Aggregation over tokens is a choice: ``"token_mean"`` weighs every valid token equally
   across the batch; ``"sequence_mean"`` averages each sequence's token mean, so long and short
   responses weigh the same; ``"token_sum_norm"`` sums each sequence's tokens and divides by a
   constant (the generation budget), so no length normalisation biases the gradient (Dr. GRPO).
4. Reward model: Bradley-Terry ``-log sigmoid(r_chosen - r_rejected - margin)``.
5. Inputs at padding positions are replaced before any arithmetic, so whatever sits there (even
   inf or nan) changes neither a loss nor a gradient.
6. KL in the loss (GRPO style): the k3 estimate of KL(policy || reference) per token, aggregated
   like the policy loss, is added with its own weight (Shao et al. 2024, DeepSeekMath, section 4.1; TRL
   ``GRPOTrainer``).
"""

from __future__ import annotations

from typing import NamedTuple, get_args

import torch
import torch.nn.functional as F

from rlhf_core.config import LossAggregation
from rlhf_core.masked import masked_mean, masked_sum
from rlhf_core.rewards import kl_estimate


def loss_denominator(
    mask: torch.Tensor, *, mode: LossAggregation = "token_mean", norm_tokens: int | None = None
) -> torch.Tensor:
    """What :func:`aggregate_loss` divides by: the valid tokens (``"token_mean"``), the sequences with a
    valid token (``"sequence_mean"``) or ``B * norm_tokens`` (``"token_sum_norm"``).

    Taken over a whole minibatch, it lets each of N processes aggregate its share of the minibatch
    so that the shares add up to the minibatch's loss (:mod:`rlhf_core.distributed`).

    Shapes:
        mask: (B, R); returns ().
    """
    valid = mask.bool()
    if mode == "token_mean":
        return valid.sum().to(torch.float32)
    if mode == "sequence_mean":
        return valid.any(dim=1).sum().to(torch.float32)
    if mode == "token_sum_norm":
        if norm_tokens is None or norm_tokens <= 0:
            raise ValueError(f"`norm_tokens` must be positive for 'token_sum_norm', got {norm_tokens}")
        return torch.tensor(float(mask.shape[0] * norm_tokens))
    raise ValueError(f"`mode` must be one of {get_args(LossAggregation)}, got {mode!r}")


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: LossAggregation = "token_mean",
    norm_tokens: int | None = None,
    denominator: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Naive equivalent of ``"token_sum_norm"``: ``sum(loss[b, t] for valid (b, t)) / (B * norm_tokens)``.

    Args:
        loss: per-token loss.
        mask: valid tokens.
        mode: ``"token_mean"`` (mean over all valid tokens), ``"sequence_mean"`` (mean over
            sequences of the per-sequence token mean; sequences without a valid token are left out)
            or ``"token_sum_norm"`` (each sequence's token sum divided by ``norm_tokens``, averaged
            over all ``B`` sequences: Dr. GRPO's constant normaliser).
        norm_tokens: the constant of ``"token_sum_norm"``, the generation budget in tokens (TRL's
            ``max_completion_length``); unused by the other modes.
        denominator: divide by this instead of :func:`loss_denominator` of ``mask``: the whole
            minibatch's, when these rows are one process's share of it.

    Shapes:
        loss, mask: (B, R); returns ().

    References:
        Liu et al. 2025 (Dr. GRPO); TRL ``GRPOTrainer`` (``loss_type="dr_grpo"``); verl
        ``agg_loss`` (``seq-mean-token-sum-norm``).
    """
    local = loss_denominator(mask, mode=mode, norm_tokens=norm_tokens)
    if denominator is None:
        if local.item() == 0:
            raise ValueError("`mask` selects no element: the masked mean is undefined")
        denominator = local
    if mode == "sequence_mean":
        return masked_sum(masked_mean(loss, mask, dim=1), mask.bool().any(dim=1)) / denominator
    return masked_sum(loss, mask) / denominator


class PolicyLossStats(NamedTuple):
    """Detached diagnostics of one policy-loss evaluation (all scalars)."""

    clip_fraction: torch.Tensor
    dual_clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
    aggregation: LossAggregation = "token_mean",
    norm_tokens: int | None = None,
    denominator: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped surrogate policy loss.

    Per token, with ``ratio = exp(logprobs - old_logprobs)``::

        loss_t = max(-A_t * ratio, -A_t * clip(ratio, 1 - eps, 1 + eps))
        if dual_clip is not None and A_t < 0:
            loss_t = min(loss_t, -dual_clip * A_t)
        loss_t = weights_t * loss_t            # when weights are given (TIS, rlhf_core.mismatch.tis_weights)

    Args:
        logprobs: current policy log-probs of the sampled tokens (with grad).
        old_logprobs: rollout-time log-probs.
        advantages: (usually whitened) advantages.
        action_mask: valid tokens.
        clip_eps: PPO clip range epsilon.
        dual_clip: the dual-clip constant ``c > 1``, or None.
        aggregation, norm_tokens, denominator: see :func:`aggregate_loss`.
        weights: per-token weights of the loss, no gradient through them (truncated importance sampling of the
            sampler's mismatch), or None for 1.

    Returns:
        The scalar loss and :class:`PolicyLossStats` (clip fractions over valid tokens, and the
        k3 estimate of KL(old || new), which is non-negative).

    Shapes:
        logprobs, old_logprobs, advantages, action_mask, weights: (B, R); returns ().

    References:
        Schulman et al. 2017, eq. 7; Ye et al. 2020 "Mastering Complex Control in MOBA Games with
        Deep RL", eq. 5; verl ``core_algos.compute_policy_loss``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"`dual_clip` must be greater than 1, got {dual_clip}")
    # Padding is selected away before any arithmetic: an inf or nan there must not reach the gradient.
    valid = action_mask.bool()
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))  # (B, R)
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))  # (B, R)
    ratio = torch.exp(log_ratio)  # (B, R)
    unclipped = -advantages * ratio  # (B, R)
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)  # (B, R)
    per_token = torch.maximum(unclipped, clipped)  # (B, R)
    dual_clipped = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        bound = -dual_clip * advantages  # (B, R)
        dual_clipped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_clipped, bound, per_token)
    if weights is not None:
        per_token = per_token * torch.where(valid, weights.detach(), torch.ones_like(per_token))  # (B, R)
    loss = aggregate_loss(per_token, action_mask, mode=aggregation, norm_tokens=norm_tokens, denominator=denominator)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_fraction=masked_mean((clipped > unclipped).to(per_token.dtype), action_mask),
            dual_clip_fraction=masked_mean(dual_clipped.to(per_token.dtype), action_mask),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, action_mask),
        )
    return loss, stats


class ValueLossStats(NamedTuple):
    """Detached diagnostics of one value-loss evaluation (scalars)."""

    clip_fraction: torch.Tensor


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    value_clip_eps: float | None = 0.2,
    aggregation: LossAggregation = "token_mean",
    norm_tokens: int | None = None,
    denominator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``.

    ``V_clip = old_values + clip(values - old_values, -value_clip_eps, value_clip_eps)``; with
    ``value_clip_eps=None`` the loss is the plain ``0.5 * (V - R)^2``. ``aggregation``, ``norm_tokens`` and
    ``denominator``: see :func:`aggregate_loss`.

    Shapes:
        values, old_values, returns, action_mask: (B, R); returns ().

    References:
        OpenAI baselines ``ppo2``; TRL ``PPOTrainer.loss``.
    """
    valid = action_mask.bool()
    values = torch.where(valid, values, torch.zeros_like(values))  # (B, R)
    old_values = torch.where(valid, old_values, torch.zeros_like(old_values))  # (B, R)
    returns = torch.where(valid, returns, torch.zeros_like(returns))  # (B, R)
    unclipped = (values - returns).square()  # (B, R)
    if value_clip_eps is None:
        per_token = unclipped
        clipped_more = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        delta = values - old_values  # (B, R)
        # Only where the clamp acts: elsewhere ``old + (values - old)`` rounds to a neighbour of ``values``, and the
        # comparison below would count float noise as clipping (a clip fraction that depends on batch shapes).
        moved = delta.abs() > value_clip_eps  # (B, R)
        values_clipped = torch.where(moved, old_values + delta.clamp(-value_clip_eps, value_clip_eps), values)  # (B, R)
        clipped = (values_clipped - returns).square()  # (B, R)
        per_token = torch.maximum(unclipped, clipped)
        clipped_more = clipped > unclipped
    loss = 0.5 * aggregate_loss(
        per_token, action_mask, mode=aggregation, norm_tokens=norm_tokens, denominator=denominator
    )
    with torch.no_grad():
        stats = ValueLossStats(clip_fraction=masked_mean(clipped_more.to(values.dtype), action_mask))
    return loss, stats


class ReferenceKLStats(NamedTuple):
    """Detached diagnostics of one reference-KL loss evaluation (scalars)."""

    kl: torch.Tensor


def reference_kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    aggregation: LossAggregation = "token_mean",
    norm_tokens: int | None = None,
    denominator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ReferenceKLStats]:
    """KL(policy || reference) as a loss term: the k3 estimate per token, aggregated like the policy loss.

    Per token, with ``d = logprobs - ref_logprobs``: ``k3 = exp(-d) - 1 + d``, which is
    non-negative, 0 where the policy agrees with the reference, and has the gradient
    ``1 - exp(-d)`` with respect to ``logprobs``.

    Args:
        logprobs: current policy log-probs of the sampled tokens (with grad).
        ref_logprobs: the frozen reference's log-probs of the same tokens (from the rollout).
        action_mask: valid tokens.
        aggregation, norm_tokens, denominator: see :func:`aggregate_loss`.

    Returns:
        The scalar loss and :class:`ReferenceKLStats` (the mean k3 over valid tokens).

    Shapes:
        logprobs, ref_logprobs, action_mask: (B, R); returns ().

    References:
        Shao et al. 2024 (DeepSeekMath, GRPO), section 4.1; TRL ``GRPOTrainer`` (``beta``); Schulman,
        "Approximating KL divergence", 2020.
    """
    valid = action_mask.bool()
    logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))  # (B, R)
    ref_logprobs = torch.where(valid, ref_logprobs, torch.zeros_like(ref_logprobs))  # (B, R)
    per_token = kl_estimate(logprobs, ref_logprobs, estimator="k3")  # (B, R)
    loss = aggregate_loss(per_token, action_mask, mode=aggregation, norm_tokens=norm_tokens, denominator=denominator)
    with torch.no_grad():
        stats = ReferenceKLStats(kl=masked_mean(per_token, action_mask))
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``, per position.

    ``H = logsumexp(z) - sum(softmax(z) * z)``, the numerically stable form. Tokens filtered out
    with ``z = -inf`` have probability 0 and add nothing (``0 * log 0 = 0``).

    Naive equivalent: ``-(softmax(z) * log_softmax(z)).sum(-1)``.

    Shapes:
        logits: (B, R, V); returns (B, R).
    """
    probabilities = torch.softmax(logits, dim=-1)  # (B, R, V)
    finite_logits = torch.where(probabilities > 0, logits, torch.zeros_like(logits))  # (B, R, V)
    return torch.logsumexp(logits, dim=-1) - (probabilities * finite_logits).sum(dim=-1)


class RewardLossStats(NamedTuple):
    """Detached diagnostics of one reward-model loss evaluation (scalars)."""

    accuracy: torch.Tensor
    margin: torch.Tensor


def pairwise_reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    pairs: int | None = None,
) -> tuple[torch.Tensor, RewardLossStats]:
    """Bradley-Terry loss ``mean(-log sigmoid(r_chosen - r_rejected - margin))``.

    At equal scores and no margin the loss is ``log 2``.

    Args:
        chosen_scores: reward-model scores of the preferred responses.
        rejected_scores: scores of the dispreferred responses.
        margin: optional per-pair margin (Llama 2's margin loss).
        pairs: divide the summed loss by this instead of ``B``: the whole minibatch's pairs, when these
            are one process's share of it.

    Returns:
        The loss and :class:`RewardLossStats`: accuracy (chosen scored strictly higher) and the
        mean score gap.

    Shapes:
        chosen_scores, rejected_scores, margin: (B,); returns ().

    References:
        Ouyang et al. 2022 eq. 1; Touvron et al. 2023 (Llama 2) eq. 2.
    """
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"`chosen_scores` {tuple(chosen_scores.shape)} and `rejected_scores` {tuple(rejected_scores.shape)} differ"
        )
    gap = chosen_scores - rejected_scores  # (B,)
    if margin is not None:
        gap = gap - margin
    per_pair = -F.logsigmoid(gap)  # (B,)
    loss = per_pair.mean() if pairs is None else per_pair.sum() / pairs
    with torch.no_grad():
        stats = RewardLossStats(
            accuracy=(chosen_scores > rejected_scores).to(chosen_scores.dtype).mean(),
            margin=(chosen_scores - rejected_scores).mean(),
        )
    return loss, stats
