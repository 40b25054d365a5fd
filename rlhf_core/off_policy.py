"""Rows an older policy sampled: how stale they are, and the PPO update's correction for them.

With ``sampling.staleness`` N >= 1 the generation stages of iteration k sample from the policy N versions behind the
one iteration k's update starts from, so a campaign can sample them while the previous update still runs. A policy's
*version* is the number of updates behind it (0: the initial policy). Every row keeps the version that sampled it
(``Experience.policy_versions``), so a row's staleness to an update is a subtraction (:func:`row_staleness`).

Choices:
1. The bound counts policy versions, as verl (one-step-off: exactly 1), NeMo-RL (``max_trajectory_age_steps``), TRL
   (``max_staleness``) and prime-rl (``max_async_level``) count them, not seconds. A row staler than the bound is
   refused, not dropped (:func:`check_staleness`): the flow samples none staler, so one would be a bug, and dropping
   it would skip its prompt.
2. Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", eq. 4; AReaL's
   ``use_decoupled_loss``; NeMo-RL's importance-sampling correction, which its async GRPO requires). Three policies:
   the behaviour policy that sampled (``old_logprobs``: the trainer's forward of the sampling policy), the proximal
   policy the update starts from (``prox_logprobs``, computed once before the first step: :func:`proximal_logprobs`),
   and the one being trained. Per token::

       loss_t = w_t * max(-A_t * r_t, -A_t * clip(r_t, 1 - eps, 1 + eps))
       r_t = pi_t / pi_prox_t        w_t = min(pi_prox_t / pi_behaviour_t, cap)

   The clip keeps the update near a policy it may move from (the proximal one) while ``w`` reweighs the stale sample
   towards it. ``cap`` truncates the weight (truncated importance sampling: IMPALA, Espeholt et al. 2018; TIS, Yao et
   al. 2025), keeping every token with a bounded weight; AReaL drops the tokens over its cap instead.
3. The other choice, ``ppo.off_policy: behaviour``: the behaviour log-probs are pi_old and no weight applies (verl's
   one-step-off trainer, TRL's async GRPO, prime-rl). Nothing is recomputed, but the ratio of a stale row starts
   away from 1, so the clip region is around a policy the update has already left and stale tokens clip sooner.
4. On-policy rows (staleness 0) need no correction: an update whose rows are all on-policy computes no pi_prox, and
   is exactly sequential PPO whatever ``ppo.off_policy`` says.
5. Both columns a replay needs are kept: the behaviour log-probs in the experience, and pi_prox is the update's input
   policy's forward, computed again by a replay of that update; so either correction can be replayed on the same
   experience.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from rlhf_core.experience import Experience
from rlhf_core.masked import masked_mean
from rlhf_core.mismatch import tis_weights
from rlhf_core.models import dropout_disabled, fused_activations
from rlhf_core.sequences import response_logits, token_logprobs


def row_staleness(policy_versions: torch.Tensor | None, version: int, *, rows: int) -> torch.Tensor:
    """How many versions each of ``rows`` rows lags behind the policy of ``version``: 0 for rows of unknown version
    (experience kept before versions were, all sampled on-policy).

    Shapes:
        policy_versions: (B,) or None; returns (B,) long.
    """
    if policy_versions is None:
        return torch.zeros(rows, dtype=torch.long)
    return version - policy_versions.long()  # (B,)


def check_staleness(staleness: torch.Tensor, *, bound: int) -> None:
    """Refuse rows staler than ``bound`` or sampled by a policy newer than the update's (choice 1).

    Shapes:
        staleness: (B,).

    Raises:
        ValueError: naming the stalest (or newest) row's lag and the bound.
    """
    if staleness.numel() and int(staleness.min()) < 0:
        raise ValueError(
            f"a row was sampled by a policy {-int(staleness.min())} version(s) newer than the one the update starts from"
        )
    if staleness.numel() and int(staleness.max()) > bound:
        raise ValueError(
            f"rows sampled {int(staleness.max())} policy versions behind the update; `sampling.staleness` allows {bound}"
        )


def decoupled_weights(
    prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, action_mask: torch.Tensor, *, cap: float
) -> torch.Tensor:
    """Decoupled PPO's behaviour weights ``min(pi_prox / pi_behaviour, cap)`` per token, 1 at padding (choice 2): the
    truncated importance weight of :func:`rlhf_core.mismatch.tis_weights`, between other two policies.

    Naive equivalent: ``[min(exp(p - b), cap) if m else 1.0 for p, b, m in zip(prox, behaviour, mask)]``.

    Shapes:
        prox_logprobs, behaviour_logprobs, action_mask: (B, R); returns (B, R).
    """
    return tis_weights(prox_logprobs, behaviour_logprobs, action_mask, cap=cap)


@torch.no_grad()
def proximal_logprobs(
    actor: PreTrainedModel, experience: Experience, *, temperature: float, batch_size: int
) -> torch.Tensor:
    """The log-probs of the experience's actions under ``actor`` (the policy an update starts from), in batches of
    ``batch_size`` rows, with the update's own forward (dropout off, the same fused activations and log-softmax), so
    an on-policy ratio starts at 1.

    Shapes:
        returns (B, R) float32 on ``experience.device``.
    """
    prompt_length = experience.prompt_length
    parts = []
    with dropout_disabled(actor), fused_activations(actor):
        for start in range(0, experience.batch_size, batch_size):
            rows = slice(start, start + batch_size)
            sequences = experience.sequences[rows]  # (b, T)
            logits = response_logits(actor, sequences, experience.attention_mask[rows], prompt_length)  # (b, R, V)
            parts.append(token_logprobs(logits, sequences[:, prompt_length:], temperature=temperature).logprobs)
    return torch.cat(parts).float()  # (B, R)


class OffPolicyStats(NamedTuple):
    """What an update's stale rows were (scalars): their largest lag, their share, and the mean behaviour weight and
    share of capped weights over their valid tokens (1 and 0 when none are stale)."""

    staleness_max: torch.Tensor
    stale_fraction: torch.Tensor
    behaviour_weight_mean: torch.Tensor
    behaviour_weight_capped: torch.Tensor


@torch.no_grad()
def off_policy_stats(experience: Experience, staleness: torch.Tensor, *, cap: float) -> OffPolicyStats:
    """:class:`OffPolicyStats` of ``experience`` whose rows lag ``staleness`` versions; the weights only where it has
    ``prox_logprobs``.

    Shapes:
        staleness: (B,).
    """
    stale = staleness > 0  # (B,)
    tokens = experience.action_mask & stale.to(experience.device)[:, None]  # (B, R)
    mean, capped = torch.tensor(1.0), torch.tensor(0.0)
    if experience.prox_logprobs is not None and bool(tokens.any()):
        weights = decoupled_weights(experience.prox_logprobs, experience.old_logprobs, tokens, cap=cap)  # (B, R)
        mean = masked_mean(weights, tokens).cpu()
        capped = masked_mean((weights >= cap).float(), tokens).cpu()
    return OffPolicyStats(
        staleness_max=staleness.max().float() if staleness.numel() else torch.tensor(0.0),
        stale_fraction=stale.float().mean(),
        behaviour_weight_mean=mean,
        behaviour_weight_capped=capped,
    )
