"""The direct preference update of the actor over one table of (chosen, rejected) pairs: DPO, IPO or SimPO.

The losses and metrics are :mod:`rlhf_core.preference_losses`'; this module owns the pairs as tensors, the policy's
log-probs of them (one forward pass for both sides), the reference's (computed once, by another stage, and read back
on every epoch and every replay), and the training loop.

Choices:
1. A pair is ``[left-padded prompt | right-padded chosen]`` and ``[the same prompt | right-padded rejected]``, the
   layout of every sequence in ``rlhf_core`` (``__init__``); both sides go through the model in one ``(2b, P + R)``
   pass, as TRL's ``concatenated_forward`` does, so the two log-probs of a pair come from one set of weights and one
   batch shape.
2. Log-probs are at temperature 1: DPO's ``log pi(y | x)`` is the model's own distribution (TRL's ``DPOTrainer``
   uses no temperature), whatever temperature sampled the candidates.
3. Dropout is off during the update (TRL's ``DPOConfig.disable_dropout``, and :mod:`rlhf_core.ppo`'s choice 2), the
   models in train mode with every dropout probability at 0 (:func:`rlhf_core.models.dropout_disabled`).
4. With N processes (``accelerate launch``) each trains on its share of every minibatch, with the loss summed over
   its pairs and divided by the whole minibatch's pair count (:mod:`rlhf_core.distributed`), as the reward model's
   training does; per-pair losses (``preference_losses``, choice 2) make that a division, not an undoing.
5. The metrics TRL's ``DPOTrainer`` logs (:func:`rlhf_core.preference_losses.preference_metrics`) are measured once
   more after the update, on every training pair (dropout off): what the update achieved on its pairs, where TRL's are
   running means over its steps; ``train_loss`` is that running mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from accelerate import Accelerator

from rlhf_core.config import DPOConfig
from rlhf_core.distributed import rank_share
from rlhf_core.divergence import MAX_SKIPPED_STEPS, check_weights, share_step
from rlhf_core.models import dropout_disabled, evaluating, fused_activations
from rlhf_core.preference_losses import (
    SequenceLogprob,
    implicit_rewards,
    preference_loss,
    preference_metrics,
    reduce_logprobs,
)
from rlhf_core.sequences import logprobs_from_logits, response_logits


@dataclass(frozen=True)
class PreferencePairs:
    """Tokenised pairs, each side's response after the same prompt; with the reference's log-probs once computed.

    Shapes:
        prompt_ids, prompt_mask: (B, P), left-padded; chosen_ids, chosen_mask, rejected_ids, rejected_mask: (B, R),
        right-padded (the masks are each response's action tokens, up to and including its end of turn);
        ref_chosen, ref_rejected: :class:`SequenceLogprob` of (B,) fields, or None before they are computed.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    ref_chosen: SequenceLogprob | None = None
    ref_rejected: SequenceLogprob | None = None

    def __post_init__(self) -> None:
        pairs, responses = self.prompt_ids.shape[0], self.chosen_ids.shape
        expected = {"prompt_mask": self.prompt_ids.shape, "rejected_ids": responses, "rejected_mask": responses}
        expected["chosen_mask"] = responses
        for name, shape in expected.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {tuple(getattr(self, name).shape)}")
        if responses[0] != pairs:
            raise ValueError(f"{pairs} prompts and {responses[0]} responses: one pair per prompt")
        for side in (self.ref_chosen, self.ref_rejected):
            if side is not None and any(part.shape != (pairs,) for part in side):
                raise ValueError(f"the reference's log-probs must have shape ({pairs},)")

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, rows: torch.Tensor) -> PreferencePairs:
        """The pairs ``rows`` (an index tensor), each with its reference log-probs."""
        return self._map(lambda tensor: tensor[rows])

    def to(self, device: torch.device | str) -> PreferencePairs:
        return self._map(lambda tensor: tensor.to(device))

    def _map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> PreferencePairs:
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, SequenceLogprob):
                value = SequenceLogprob(*(function(part) for part in value))
            values[f.name] = None if value is None else function(value) if isinstance(value, torch.Tensor) else value
        return PreferencePairs(**values)

    def with_reference(self, chosen: SequenceLogprob, rejected: SequenceLogprob) -> PreferencePairs:
        """These pairs with the reference's log-probs of both sides."""
        return PreferencePairs(
            *(getattr(self, f.name) for f in fields(self) if f.name not in ("ref_chosen", "ref_rejected")),
            ref_chosen=chosen,
            ref_rejected=rejected,
        )


def pair_logprobs(model: torch.nn.Module, pairs: PreferencePairs) -> tuple[SequenceLogprob, SequenceLogprob]:
    """The log-prob of each pair's chosen and rejected response under ``model``: one forward pass of both (choice 1),
    at temperature 1 (choice 2); with grad where the model has it.

    Naive equivalent, per pair ``b`` and side ``y`` (its action tokens ``y_1 .. y_n``)::

        total[b] = sum(log softmax(model(prompt + y[:t]))[y_t] for t in 1..n); mean[b] = total[b] / n

    Shapes:
        returns two :class:`SequenceLogprob` of (B,) fields: chosen, rejected.
    """
    prompt_length = pairs.prompt_ids.shape[1]  # P
    prompts = pairs.prompt_ids.repeat(2, 1)  # (2B, P)
    prompt_mask = pairs.prompt_mask.repeat(2, 1)  # (2B, P)
    responses = torch.cat([pairs.chosen_ids, pairs.rejected_ids])  # (2B, R)
    action_mask = torch.cat([pairs.chosen_mask, pairs.rejected_mask]).bool()  # (2B, R)
    sequences = torch.cat([prompts, responses], dim=1)  # (2B, P + R)
    attention_mask = torch.cat([prompt_mask, action_mask.to(prompt_mask.dtype)], dim=1)  # (2B, P + R)
    logits = response_logits(model, sequences, attention_mask, prompt_length)  # (2B, R, V)
    logprobs = logprobs_from_logits(logits.float(), responses)  # (2B, R), fp32 whatever the forward's precision
    both = reduce_logprobs(logprobs, action_mask)  # two (2B,)
    chosen = SequenceLogprob(both.total[: len(pairs)], both.mean[: len(pairs)])  # (B,) each
    rejected = SequenceLogprob(both.total[len(pairs) :], both.mean[len(pairs) :])  # (B,) each
    return chosen, rejected


@torch.no_grad()
def reference_logprobs(
    reference: torch.nn.Module, pairs: PreferencePairs, *, batch_size: int
) -> tuple[SequenceLogprob, SequenceLogprob]:
    """The reference's log-probs of every pair (:func:`pair_logprobs`, in eval mode), ``batch_size`` pairs a pass:
    what a DPO update and every replay of it read back instead of running the reference.

    Shapes:
        returns two :class:`SequenceLogprob` of (B,) fields: chosen, rejected.
    """
    sides: list[list[SequenceLogprob]] = [[], []]
    with evaluating(reference), fused_activations(reference):
        for start in range(0, len(pairs), batch_size):
            batch = pairs.select(
                torch.arange(start, min(start + batch_size, len(pairs)), device=pairs.chosen_ids.device)
            )
            for side, logprob in zip(sides, pair_logprobs(reference, batch), strict=True):
                side.append(logprob)
    chosen, rejected = (SequenceLogprob(*(torch.cat(parts) for parts in zip(*side, strict=True))) for side in sides)
    return chosen, rejected


class DPOProgress(NamedTuple):
    """Where a DPO update stands after a whole epoch: enough to continue it exactly after a crash."""

    epochs_done: int
    loss_sum: float
    optimizer_steps: int


class PairMeasures(NamedTuple):
    """Each pair as the policy sees it after the update (choice 5): the log-probs of its two responses (sums, as TRL
    reports them) and their implicit rewards (:func:`rlhf_core.preference_losses.implicit_rewards`, as the loss
    defines them: on per-token means for SimPO). What TRL's metrics are the means of.

    Shapes:
        each field: (B,), fp32, on the CPU.
    """

    logps_chosen: torch.Tensor
    logps_rejected: torch.Tensor
    rewards_chosen: torch.Tensor
    rewards_rejected: torch.Tensor


class DPOStats(NamedTuple):
    """What a DPO update did: TRL's metrics of its pairs after it (choice 5), each pair's measures, and its steps.

    ``metrics`` holds ``loss`` and the six of :func:`rlhf_core.preference_losses.preference_metrics`, by TRL's names
    (``rewards/chosen``, ...): Python floats.
    """

    metrics: dict[str, float]
    pairs: PairMeasures
    train_loss: float
    optimizer_steps: int
    skipped_steps: int = 0
    """Steps the fp16 loss scaler skipped (its scaled loss overflowed)."""


def _loss(actor: torch.nn.Module, pairs: PreferencePairs, config: DPOConfig) -> tuple[torch.Tensor, dict]:
    """Per-pair losses of ``pairs`` under ``actor`` and the inputs of their metrics.

    Shapes:
        returns (B,) losses, and the policy's and reference's log-probs of each side.
    """
    chosen, rejected = pair_logprobs(actor, pairs)
    losses = preference_loss(
        chosen, rejected, pairs.ref_chosen, pairs.ref_rejected, loss=config.loss, beta=config.beta,
        label_smoothing=config.label_smoothing, gamma=config.simpo_gamma if config.loss == "simpo" else 0.0,
    )  # fmt: skip
    return losses, {"chosen": chosen, "rejected": rejected}


@torch.no_grad()
def measure_pairs(
    actor: torch.nn.Module, pairs: PreferencePairs, config: DPOConfig, *, batch_size: int
) -> tuple[dict[str, float], PairMeasures]:
    """TRL ``DPOTrainer``'s metrics of ``pairs`` under ``actor`` (dropout off), by its names, and ``loss``: summed
    log-probs as TRL reports them, per-token means for SimPO's reference-free reward (its loss's own); and each
    pair's measures they are the means of."""
    losses, policy = [], {"chosen": [], "rejected": []}
    with evaluating(actor):
        for start in range(0, len(pairs), batch_size):
            batch = pairs.select(
                torch.arange(start, min(start + batch_size, len(pairs)), device=pairs.chosen_ids.device)
            )
            loss, logprobs = _loss(actor, batch, config)
            losses.append(loss.float())
            for side in policy:
                policy[side].append(logprobs[side])
    chosen, rejected = (
        SequenceLogprob(*(torch.cat(parts) for parts in zip(*policy[side], strict=True))) for side in policy
    )
    if config.loss == "simpo":
        sides, reference = (chosen.mean, rejected.mean), None
    else:
        assert pairs.ref_chosen is not None and pairs.ref_rejected is not None
        sides, reference = (chosen.total, rejected.total), (pairs.ref_chosen.total, pairs.ref_rejected.total)
    metrics = preference_metrics(*sides, *(reference or (None, None)), beta=config.beta)
    rewards = implicit_rewards(*sides, reference, beta=config.beta)  # (B,) each
    measures = PairMeasures(*(value.float().cpu() for value in (chosen.total, rejected.total, *rewards)))
    loss = torch.cat(losses).mean().item()
    return {"loss": loss, **{name: value.item() for name, value in metrics.items()}}, measures


def dpo_update(
    actor: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pairs: PreferencePairs,
    config: DPOConfig,
    *,
    accelerator: Accelerator,
    generator: torch.Generator | None = None,
    resume: DPOProgress | None = None,
    on_epoch_end: Callable[[DPOProgress], None] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    max_skipped_steps: int = MAX_SKIPPED_STEPS,
) -> DPOStats:
    """Train ``actor`` for ``config.epochs`` epochs on ``pairs`` (shuffled by ``generator``), ``config.batch_size``
    pairs an optimizer step, by the loss ``config.loss`` against the reference log-probs ``pairs`` carries.

    Args:
        actor, optimizer: ``accelerator.prepare``d.
        pairs: tokenised pairs with the reference's log-probs (none needed for SimPO).
        config: the loss, its ``beta``, the schedule.
        accelerator: drives backward passes and clipping.
        generator: CPU random stream for shuffling.
        resume: continue after ``resume.epochs_done`` epochs; the caller restores the model, optimizer and
            ``generator`` states saved at that point.
        on_epoch_end: called after every epoch, e.g. to save a checkpoint of all of those.
        on_step: called after every optimizer step with the step number (from 1) and the minibatch's ``loss``.
        max_skipped_steps: under fp16's loss scaler, the steps it may skip in a row before training counts as
            diverged (:data:`rlhf_core.divergence.MAX_SKIPPED_STEPS`).

    Raises:
        ValueError: no pairs, or a loss that needs the reference's log-probs without them.
    """
    if len(pairs) == 0:
        raise ValueError("a DPO update needs at least one pair")
    if config.loss != "simpo" and pairs.ref_chosen is None:
        raise ValueError(f"the {config.loss!r} loss needs the reference's log-probs of the pairs")
    pairs = pairs.to(accelerator.device)
    loss_sum, steps = (resume.loss_sum, resume.optimizer_steps) if resume else (0.0, 0)
    world, rank = accelerator.num_processes, accelerator.process_index
    in_a_row, skipped = 0, 0  # fp16's skipped steps: see rlhf_core.divergence
    with dropout_disabled(actor), fused_activations(actor):
        for epoch in range(resume.epochs_done if resume else 0, config.epochs):
            order = torch.randperm(len(pairs), generator=generator)
            for start in range(0, len(pairs), config.batch_size):
                # 1. this process's share of the minibatch; the loss divides by the whole minibatch's pairs
                minibatch = order[start : start + config.batch_size]
                share, weight = rank_share(len(minibatch), rank=rank, world=world)
                losses, _ = _loss(actor, pairs.select(minibatch[share].to(accelerator.device)), config)  # (b,)
                loss = losses.sum() / len(minibatch)
                # 2. DDP averages the processes' gradients: each backpropagates N times its share (a non-finite loss
                #    or gradient norm stops the update before its step; under fp16's loss scaler a non-finite norm is a
                #    skipped step, and only max_skipped_steps in a row are); the whole minibatch's loss
                in_a_row, step_loss = share_step(
                    accelerator, optimizer, actor, loss, weight=weight, max_grad_norm=config.max_grad_norm,
                    in_a_row=in_a_row, limit=max_skipped_steps,
                    diverged={"model": "actor", "step": steps + 1, "learning_rate": config.learning_rate},
                )  # fmt: skip
                skipped += in_a_row > 0
                loss_sum += step_loss
                steps += 1
                if on_step is not None:
                    on_step(steps, {"loss": step_loss})
            if on_epoch_end is not None:
                on_epoch_end(DPOProgress(epoch + 1, loss_sum, steps))
    check_weights(actor, model="actor", learning_rate=config.learning_rate)
    # Every process measures every pair, on the model without its DDP wrapper.
    metrics, measures = measure_pairs(accelerator.unwrap_model(actor), pairs, config, batch_size=config.batch_size)
    return DPOStats(metrics, measures, train_loss=loss_sum / steps, optimizer_steps=steps, skipped_steps=skipped)
