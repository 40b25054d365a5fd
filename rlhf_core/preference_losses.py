"""Direct preference losses (DPO, IPO, SimPO) on the log-probs of (chosen, rejected) response pairs, and their metrics.

A pair is two responses to one prompt, the chosen one preferred. Each loss reads one log-prob per response
(:func:`reduce_logprobs` makes them from per-token log-probs), so a replay with another ``beta`` or loss needs
the stored reference log-probs only, never the reference model.

Choices:
1. A response's log-prob is the sum of its action tokens' log-probs, ``log pi(y | x)`` (Rafailov et al. 2023,
   eq. 7); the length-normalised one is their mean, ``log pi(y | x) / |y|`` (Meng et al. 2024, SimPO's reward).
   Both come from :mod:`rlhf_core.masked`, so padding never changes them; a row with no action token is an error
   (the action mask holds the EOS, so a real response has at least one).
2. The losses return one value per pair, ``(B,)``, and the caller reduces: a DPO update split over processes or
   gradient-accumulation steps divides the sum of its share by the whole minibatch's pair count (as
   :func:`rlhf_core.losses.pairwise_reward_loss` does with ``pairs``), and a returned mean would have to be undone
   first. TRL's ``DPOTrainer.dpo_loss`` returns per-pair losses too.
3. DPO's sigmoid loss is ``-log sigmoid(beta * h)`` with ``h = (pi_c - ref_c) - (pi_r - ref_r)`` on summed
   log-probs (Rafailov et al. 2023, eq. 7), and label smoothing ``eps`` gives the conservative DPO (cDPO) form
   ``(1 - eps) * -log sigmoid(beta * h) + eps * -log sigmoid(-beta * h)`` (Mitchell 2023, "A note on DPO with noisy
   preferences"; TRL ``DPOTrainer.dpo_loss`` at a68fb896f008f58a3d37abf11ae665357b7c679a; since its DPO refactor,
   #3906, TRL reads label smoothing in its ``robust`` and ``exo_pair`` losses only).
4. IPO is ``(h - 1 / (2 * beta))^2`` (Azar et al. 2023, eq. 17, with ``tau = beta``) on per-token MEAN log-probs,
   as TRL's ``DPOTrainer`` computes it for ``loss_type="ipo"`` (``_compute_loss`` at
   f2cd57710ae345ea6428ae95363267fcf38a3dc8 divides each log-ratio by its completion length; before the refactor
   ``concatenated_forward`` divided the log-probs; TRL's comment says the IPO authors confirmed that the paper's
   results use this normalised form). On sums, ``h`` grows with the responses' length while the target
   ``1 / (2 * beta)`` does not, so one ``beta`` would mean a different regularisation for every length.
   :func:`preference_loss` passes the means; :func:`ipo_loss` itself takes whatever log-probs it is given.
5. SimPO is reference-free: ``-log sigmoid(beta * (mean_c - mean_r) - gamma)`` on per-token mean log-probs, with
   ``gamma`` the target reward margin in reward units (Meng et al. 2024, the SimPO objective; TRL ``CPOTrainer`` with
   ``loss_type="simpo"`` writes the same as ``beta * (mean_c - mean_r - gamma / beta)``). No label smoothing: the
   paper has none.
6. The metrics are TRL ``DPOTrainer``'s, by its names: ``rewards/chosen`` is the implicit reward
   ``beta * (pi_c - ref_c)`` (Rafailov et al. 2023, eq. 5), ``rewards/accuracies`` the fraction of pairs whose
   chosen reward is strictly higher (a tie counts as wrong), ``rewards/margins`` the mean reward gap,
   ``logps/*`` the mean policy log-probs. TRL's ``DPOTrainer`` reports them on summed log-probs whatever the loss,
   IPO's included. Without a reference (SimPO) the reward is ``beta * log-prob``, SimPO's reward when given mean
   log-probs (TRL ``CPOTrainer`` logs the same).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlhf_core.config import PreferenceLoss
from rlhf_core.masked import masked_mean, masked_sum

SequencePair = tuple[torch.Tensor, torch.Tensor]
"""A value of each response of each pair: ``(chosen, rejected)``, (B,) each."""


class SequenceLogprob(NamedTuple):
    """One log-prob per response: the sum over its action tokens (``total``) and the mean per token (``mean``).

    Shapes:
        total, mean: (B,).
    """

    total: torch.Tensor
    mean: torch.Tensor


def reduce_logprobs(logprobs: torch.Tensor, action_mask: torch.Tensor) -> SequenceLogprob:
    """The log-prob of each response from its tokens' log-probs: their sum and their mean per token (choice 1).

    Naive equivalent::

        for b in range(B):
            tokens = [logprobs[b, t] for t in range(R) if action_mask[b, t]]
            total[b], mean[b] = sum(tokens), sum(tokens) / len(tokens)

    Args:
        logprobs: per-token log-probs of the response tokens (:func:`rlhf_core.sequences.response_logprobs`),
            with grad for the policy. Whatever sits at padding, even inf or nan, is selected away.
        action_mask: True for each response token up to and including EOS.

    Shapes:
        logprobs, action_mask: (B, R); returns two (B,).

    Raises:
        ValueError: mismatched shapes, or a row with no action token.
    """
    if logprobs.shape != action_mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"`logprobs` {tuple(logprobs.shape)} and `action_mask` {tuple(action_mask.shape)} must be equal (B, R)"
        )
    if not bool(action_mask.bool().any(dim=1).all()):
        raise ValueError("a response has no action token: its log-prob per token is undefined")
    return SequenceLogprob(
        total=masked_sum(logprobs, action_mask, dim=1),  # (B,)
        mean=masked_mean(logprobs, action_mask, dim=1),  # (B,)
    )


def _check_pairs(**logprobs: torch.Tensor) -> None:
    shapes = {name: tuple(value.shape) for name, value in logprobs.items()}
    first = next(iter(shapes.values()))
    if len(first) != 1 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"the log-probs of a batch of pairs must be equal 1-D shapes (B,), got {shapes}")


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"`beta` must be positive, got {beta}")


def preference_log_ratio(
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor,
    ref_rejected_logprobs: torch.Tensor,
) -> torch.Tensor:
    """``h = (pi_c - ref_c) - (pi_r - ref_r)``: how much more the policy than the reference prefers the chosen one.

    Shapes:
        each argument: (B,); returns (B,).
    """
    _check_pairs(
        chosen=chosen_logprobs, rejected=rejected_logprobs, ref_c=ref_chosen_logprobs, ref_r=ref_rejected_logprobs
    )
    return (chosen_logprobs - ref_chosen_logprobs) - (rejected_logprobs - ref_rejected_logprobs)


def dpo_sigmoid_loss(
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor,
    ref_rejected_logprobs: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO's loss per pair, ``(1 - eps) * -log sigmoid(beta * h) + eps * -log sigmoid(beta * -h)`` (choice 3).

    Equivalently ``-log sigmoid(beta * h) + eps * beta * h``, since ``-log sigmoid(-x) = -log sigmoid(x) + x``.

    Args:
        chosen_logprobs, rejected_logprobs: the policy's summed log-probs of each response (with grad).
        ref_chosen_logprobs, ref_rejected_logprobs: the reference's, of the same responses.
        beta: the strength of the KL regularisation to the reference (TRL's default is 0.1).
        label_smoothing: ``eps``, the assumed probability that a pair's label is flipped (cDPO), in [0, 0.5);
            0 is plain DPO.

    Shapes:
        each log-prob argument: (B,); returns (B,).

    References:
        Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; Mitchell 2023 (cDPO); TRL
        ``DPOTrainer.dpo_loss`` (``loss_type="sigmoid"``) at a68fb896f008f58a3d37abf11ae665357b7c679a.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {label_smoothing}")
    logits = beta * preference_log_ratio(
        chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs
    )  # (B,)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def ipo_loss(
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor,
    ref_rejected_logprobs: torch.Tensor,
    *,
    beta: float,
) -> torch.Tensor:
    """IPO's loss per pair, ``(h - 1 / (2 * beta))^2``: ``h`` is pulled to the target ``1 / (2 * beta)``, not
    pushed without end as DPO's sigmoid does (choice 4).

    Pass per-token MEAN log-probs (:attr:`SequenceLogprob.mean`, as :func:`preference_loss` does) for TRL's form.

    Args:
        chosen_logprobs, rejected_logprobs: the policy's log-probs of each response (with grad).
        ref_chosen_logprobs, ref_rejected_logprobs: the reference's, reduced the same way.
        beta: IPO's ``tau``; a larger one sets a smaller target gap.

    Shapes:
        each log-prob argument: (B,); returns (B,).

    References:
        Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17;
        TRL ``DPOTrainer._compute_loss`` (``loss_type="ipo"``) at f2cd57710ae345ea6428ae95363267fcf38a3dc8.
    """
    _check_beta(beta)
    h = preference_log_ratio(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)  # (B,)
    return (h - 1.0 / (2.0 * beta)).square()


def simpo_loss(
    chosen_logprobs: torch.Tensor, rejected_logprobs: torch.Tensor, *, beta: float, gamma: float
) -> torch.Tensor:
    """SimPO's loss per pair, ``-log sigmoid(beta * (mean_c - mean_r) - gamma)``, with no reference (choice 5).

    Args:
        chosen_logprobs, rejected_logprobs: the policy's per-token MEAN log-probs of each response (with grad).
        beta: the reward scale; a mean log-prob is a per-token quantity, so it is usually set well above DPO's.
        gamma: the target reward margin, in reward units (TRL's ``CPOConfig`` default ``simpo_gamma`` is 0.5).

    Shapes:
        chosen_logprobs, rejected_logprobs: (B,); returns (B,).

    References:
        Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward" (arXiv 2405.14734); TRL
        ``CPOTrainer.cpo_loss`` (``loss_type="simpo"``) at f2cd57710ae345ea6428ae95363267fcf38a3dc8.
    """
    _check_beta(beta)
    _check_pairs(chosen=chosen_logprobs, rejected=rejected_logprobs)
    return -F.logsigmoid(beta * (chosen_logprobs - rejected_logprobs) - gamma)


def preference_loss(
    chosen: SequenceLogprob,
    rejected: SequenceLogprob,
    ref_chosen: SequenceLogprob | None,
    ref_rejected: SequenceLogprob | None,
    *,
    loss: PreferenceLoss,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> torch.Tensor:
    """The per-pair loss named ``loss``, each fed the log-probs its convention reads: sums for ``sigmoid``, per-token
    means for ``ipo`` and ``simpo`` (choices 3 to 5).

    Args:
        chosen, rejected: the policy's :func:`reduce_logprobs` of each response (with grad).
        ref_chosen, ref_rejected: the reference's, or None for ``simpo``, which reads none.
        loss: ``sigmoid``, ``ipo`` or ``simpo``.
        beta: see each loss.
        label_smoothing: cDPO's ``eps``, for ``sigmoid`` only.
        gamma: SimPO's target reward margin, for ``simpo`` only.

    Shapes:
        each field of each argument: (B,); returns (B,).

    Raises:
        ValueError: an unknown loss, a setting the loss does not read, or no reference for a loss that needs one.
    """
    if loss not in ("sigmoid", "ipo", "simpo"):
        raise ValueError(f"`loss` must be one of ['sigmoid', 'ipo', 'simpo'], got {loss!r}")
    if label_smoothing and loss != "sigmoid":
        raise ValueError(f"`label_smoothing` is the sigmoid loss's only, got {label_smoothing} for {loss!r}")
    if gamma and loss != "simpo":
        raise ValueError(f"`gamma` is SimPO's only, got {gamma} for {loss!r}")
    if loss == "simpo":
        return simpo_loss(chosen.mean, rejected.mean, beta=beta, gamma=gamma)
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"the {loss!r} loss needs the reference's log-probs of both responses")
    if loss == "ipo":
        return ipo_loss(chosen.mean, rejected.mean, ref_chosen.mean, ref_rejected.mean, beta=beta)
    return dpo_sigmoid_loss(
        chosen.total, rejected.total, ref_chosen.total, ref_rejected.total, beta=beta, label_smoothing=label_smoothing
    )


@torch.no_grad()
def implicit_rewards(
    chosen_logprobs: torch.Tensor, rejected_logprobs: torch.Tensor, reference: SequencePair | None, *, beta: float
) -> SequencePair:
    """DPO's implicit reward of each response of each pair: ``beta * (pi - ref)``, or ``beta * pi`` without a
    ``reference`` (SimPO's, on per-token means); the per-pair values behind :func:`preference_metrics`.

    Shapes:
        ``chosen_logprobs``, ``rejected_logprobs`` and each of ``reference``: (B,); returns (chosen, rejected), (B,)
        each.
    """
    if reference is None:
        _check_pairs(chosen=chosen_logprobs, rejected=rejected_logprobs)
        return beta * chosen_logprobs, beta * rejected_logprobs  # (B,) each
    _check_pairs(chosen=chosen_logprobs, rejected=rejected_logprobs, ref_c=reference[0], ref_r=reference[1])
    return beta * (chosen_logprobs - reference[0]), beta * (rejected_logprobs - reference[1])


@torch.no_grad()
def preference_metrics(
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor | None,
    ref_rejected_logprobs: torch.Tensor | None,
    *,
    beta: float,
) -> dict[str, torch.Tensor]:
    """TRL ``DPOTrainer``'s metrics of a batch of pairs, by its names, as detached scalars (choice 6).

    A dict, not a NamedTuple: the names are the field's own (``rewards/chosen``), which no Python field can spell.

    * ``rewards/chosen``, ``rewards/rejected``: mean of ``beta * (pi - ref)`` (``beta * pi`` without a reference);
    * ``rewards/accuracies``: fraction of pairs whose chosen reward is strictly higher;
    * ``rewards/margins``: mean of chosen reward minus rejected reward;
    * ``logps/chosen``, ``logps/rejected``: mean policy log-prob.

    Args:
        chosen_logprobs, rejected_logprobs: the policy's log-probs of each response (sums, as TRL's DPOTrainer
            reports them; per-token means for SimPO's reward).
        ref_chosen_logprobs, ref_rejected_logprobs: the reference's, or None (both) for a reference-free loss.
        beta: the loss's ``beta``.

    Shapes:
        each log-prob argument: (B,); returns six ().

    References:
        TRL ``DPOTrainer._compute_loss`` at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (its logged metrics).
    """
    if (ref_chosen_logprobs is None) != (ref_rejected_logprobs is None):
        raise ValueError("pass the reference's log-probs of both responses, or of neither")
    reference = None if ref_chosen_logprobs is None else (ref_chosen_logprobs, ref_rejected_logprobs)
    chosen_rewards, rejected_rewards = implicit_rewards(chosen_logprobs, rejected_logprobs, reference, beta=beta)
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logprobs.mean(),
        "logps/rejected": rejected_logprobs.mean(),
    }
