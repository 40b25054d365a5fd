"""Reward-model training over preference pairs (Bradley-Terry), driven through Accelerate.

Choices:
1. Chosen and rejected responses of a minibatch go through the model in one ``(2b, T)`` pass.
2. Held-out accuracy, loss, and the mean / std of scores on held-out responses are reported;
   the pipeline uses the latter to normalise scores before PPO.
3. Dropout stays on during training (the model is in train mode) and off for evaluation.
4. With N processes (``accelerate launch``) each trains on its share of every minibatch, with the loss
   divided by the whole minibatch's pairs, so the result equals one process's up to float rounding when
   the model has no dropout (with dropout, each process draws its own masks, seeded per epoch and process)
   (:mod:`rlhf_core.distributed`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from accelerate import Accelerator

from rlhf_core.config import RewardModelConfig, held_out_positions
from rlhf_core.distributed import global_sum, rank_share
from rlhf_core.divergence import MAX_SKIPPED_STEPS, check_weights, guarded_step
from rlhf_core.losses import pairwise_reward_loss
from rlhf_core.models import RewardModel, evaluating, fused_activations


@dataclass(frozen=True)
class PreferenceBatch:
    """Tokenised preference pairs; chosen and rejected share one padded length T.

    Shapes:
        chosen_ids, chosen_mask, rejected_ids, rejected_mask: (B, T); margin: (B,).
    """

    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    margin: torch.Tensor

    def __post_init__(self) -> None:
        shape = self.chosen_ids.shape
        for name in ("chosen_mask", "rejected_ids", "rejected_mask"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {tuple(getattr(self, name).shape)}")
        if self.margin.shape != (shape[0],):
            raise ValueError(f"`margin` must have shape ({shape[0]},), got {tuple(self.margin.shape)}")

    def __len__(self) -> int:
        return self.chosen_ids.shape[0]

    def select(self, rows: torch.Tensor) -> PreferenceBatch:
        return PreferenceBatch(
            self.chosen_ids[rows],
            self.chosen_mask[rows],
            self.rejected_ids[rows],
            self.rejected_mask[rows],
            self.margin[rows],
        )

    def to(self, device: torch.device | str) -> PreferenceBatch:
        return PreferenceBatch(
            *(
                tensor.to(device)
                for tensor in (self.chosen_ids, self.chosen_mask, self.rejected_ids, self.rejected_mask, self.margin)
            )
        )


def arrival_split(
    sizes: Sequence[int], seeds: Sequence[int], eval_fraction: float, *, held_out_heads: Sequence[int | None] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training and held-out rows of preference tables of ``sizes`` rows each, concatenated in this order (the
    order they arrived in, one table an iteration): each table's rows in an order drawn from its own seed (from
    the table, never from the iteration reading it), then held out by :func:`rlhf_core.config.held_out_positions`
    over all of them. A table's rows are split alike by every later iteration, so a reward model that continues
    the previous one never trains on a pair that model was measured on.

    A table whose pairs were asked about by margin (``asking.select``) says which of its rows were drawn at random
    for holding out: its first ``held_out_heads[i]`` rows. Those are held out and its other rows trained on; the
    tables without one (None; every table where ``held_out_heads`` is empty) are split as above among themselves.

    Shapes:
        returns two (N,) int64 index tensors into the concatenation, together a permutation of ``range(sum(sizes))``.
    """
    heads = list(held_out_heads) or [None] * len(sizes)
    offsets = [sum(sizes[:index]) for index in range(len(sizes))]
    orders = [
        offset + torch.randperm(size, generator=torch.Generator().manual_seed(seed))
        for offset, size, seed, head in zip(offsets, sizes, seeds, heads, strict=True)
        if head is None
    ]
    order = torch.cat(orders) if orders else torch.zeros(0, dtype=torch.long)
    held = torch.tensor(held_out_positions(len(order), eval_fraction), dtype=torch.bool)
    train, held_out = [order[~held]], [order[held]]
    for offset, size, head in zip(offsets, sizes, heads, strict=True):
        if head is not None:
            held_out.append(torch.arange(offset, offset + head))
            train.append(torch.arange(offset + head, offset + size))
    return torch.cat(train), torch.cat(held_out)


def replayed_rows(train: torch.Tensor, *, new_from: int, ratio: float, generator: torch.Generator) -> torch.Tensor:
    """The training rows of a reward model that continues the previous one with a replay: every row of ``train``
    at or after ``new_from`` (this iteration's table), and ``round(ratio * new)`` of the older ones (all of them
    when there are fewer), drawn without replacement from ``generator``; new rows first, then the drawn ones in
    the order drawn (training shuffles them anyway).

    Shapes:
        train: (N,) int64 row indices (:func:`arrival_split`); returns (M,) int64, M <= N.
    """
    new, older = train[train >= new_from], train[train < new_from]
    count = min(len(older), round(ratio * len(new)))
    drawn = older[torch.randperm(len(older), generator=generator)[:count]]
    return torch.cat([new, drawn])


class RewardModelStats(NamedTuple):
    """Training and held-out figures (Python floats), plus the step count."""

    train_loss: float
    train_accuracy: float
    eval_loss: float
    eval_accuracy: float
    score_mean: float
    score_std: float
    optimizer_steps: int
    skipped_steps: int = 0
    """Steps the fp16 loss scaler skipped (its scaled loss overflowed)."""


def _pair_scores(model: RewardModel, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes: returns two (b,)."""
    ids = torch.cat([batch.chosen_ids, batch.rejected_ids])  # (2b, T)
    mask = torch.cat([batch.chosen_mask, batch.rejected_mask])  # (2b, T)
    scores = model(ids, mask)  # (2b,)
    return scores[: len(batch)], scores[len(batch) :]


class RewardModelEval(NamedTuple):
    """A reward model's figures on held-out pairs (Python floats)."""

    loss: float
    accuracy: float
    score_mean: float
    score_std: float


@torch.no_grad()
def evaluate_reward_model(model: RewardModel, pairs: PreferenceBatch, *, batch_size: int) -> RewardModelEval:
    """Loss, accuracy, score mean and score std of ``model`` on ``pairs`` (dropout off)."""
    chosen_all, rejected_all = [], []
    with evaluating(model):
        for start in range(0, len(pairs), batch_size):
            chosen, rejected = _pair_scores(
                model, pairs.select(torch.arange(start, min(start + batch_size, len(pairs))))
            )
            chosen_all.append(chosen.float())
            rejected_all.append(rejected.float())
    chosen, rejected = torch.cat(chosen_all), torch.cat(rejected_all)
    loss, stats = pairwise_reward_loss(chosen, rejected)
    all_scores = torch.cat([chosen, rejected])
    return RewardModelEval(loss.item(), stats.accuracy.item(), all_scores.mean().item(), all_scores.std().item())


class RewardTrainingProgress(NamedTuple):
    """Where training stands after a whole epoch: enough to continue it exactly after a crash."""

    epochs_done: int
    loss_sum: float
    accuracy_sum: float
    optimizer_steps: int


def epoch_seed(seed: int, *, epoch: int, rank: int) -> int:
    """A seed from the coordinates ``(seed, epoch, rank)``, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/epoch-{epoch}/rank-{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def fit_reward_model(
    model: RewardModel,
    optimizer: torch.optim.Optimizer,
    train_pairs: PreferenceBatch,
    eval_pairs: PreferenceBatch,
    config: RewardModelConfig,
    *,
    accelerator: Accelerator,
    generator: torch.Generator | None = None,
    resume: RewardTrainingProgress | None = None,
    on_epoch_end: Callable[[RewardTrainingProgress], None] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    dropout_seed: int | None = None,
    max_skipped_steps: int = MAX_SKIPPED_STEPS,
) -> RewardModelStats:
    """Train ``model`` for ``config.epochs`` epochs on ``train_pairs``; evaluate on ``eval_pairs``.

    Args:
        model, optimizer: ``accelerator.prepare``d.
        train_pairs, eval_pairs: tokenised preference pairs.
        config: learning schedule, batch size, gradient clip, margin use.
        accelerator: drives backward passes and clipping.
        generator: CPU random stream for shuffling.
        resume: continue after ``resume.epochs_done`` epochs; the caller restores the model,
            optimizer, ``generator`` and global RNG (dropout) states saved at that point.
        on_epoch_end: called after every epoch, e.g. to save a checkpoint of all of those.
        on_step: called after every optimizer step with the step number (from 1) and the batch's
            ``loss`` and ``accuracy``, e.g. to record training curves.
        dropout_seed: seed torch's global RNG, which draws the dropout masks, at the start of every epoch from
            ``(dropout_seed, epoch, process index)`` (:func:`epoch_seed`): every process draws its own masks,
            and a run resumed at an epoch draws the masks of one that never stopped, in any process. None
            leaves the global RNG to the caller.
        max_skipped_steps: under fp16's loss scaler, the steps it may skip in a row before training counts as
            diverged (:data:`rlhf_core.divergence.MAX_SKIPPED_STEPS`).
    """
    if len(train_pairs) == 0 or len(eval_pairs) == 0:
        raise ValueError(f"need training and held-out pairs, got {len(train_pairs)} and {len(eval_pairs)}")
    train_pairs, eval_pairs = train_pairs.to(accelerator.device), eval_pairs.to(accelerator.device)
    model.train()
    loss_sum, accuracy_sum, steps = (
        (resume.loss_sum, resume.accuracy_sum, resume.optimizer_steps) if resume else (0.0, 0.0, 0)
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    scaled, in_a_row, skipped = accelerator.scaler is not None, 0, 0  # fp16: see rlhf_core.divergence
    with fused_activations(model):
        for epoch in range(resume.epochs_done if resume else 0, config.epochs):
            if dropout_seed is not None:
                torch.manual_seed(epoch_seed(dropout_seed, epoch=epoch, rank=rank))
            order = torch.randperm(len(train_pairs), generator=generator)
            for start in range(0, len(train_pairs), config.batch_size):
                # 1. this process's share of the minibatch; the loss divides by the whole minibatch's pairs
                minibatch = order[start : start + config.batch_size]
                share, weight = rank_share(len(minibatch), rank=rank, world=world)
                batch = train_pairs.select(minibatch[share].to(accelerator.device))
                chosen, rejected = _pair_scores(model, batch)
                loss, stats = pairwise_reward_loss(
                    chosen, rejected, margin=batch.margin if config.use_margin else None, pairs=len(minibatch)
                )
                # 2. DDP averages the processes' gradients: each backpropagates N times its share
                #    (a non-finite loss or gradient norm stops training before its step: it diverged; under fp16's
                #    loss scaler a non-finite norm is a skipped step, and only max_skipped_steps in a row are)
                in_a_row = guarded_step(
                    accelerator, optimizer, model, loss, scale=world * weight, max_grad_norm=config.max_grad_norm,
                    scaled=scaled, in_a_row=in_a_row, limit=max_skipped_steps,
                    diverged={"model": "reward_model", "step": steps + 1, "learning_rate": config.learning_rate},
                )  # fmt: skip
                skipped += in_a_row > 0
                # 3. the whole minibatch's loss and accuracy (the shares' sum, and their pair-weighted mean)
                if world == 1:
                    step_loss, step_accuracy = loss.item(), stats.accuracy.item()
                else:
                    pairs = weight * len(share)
                    shares = torch.stack([loss.detach() * weight, stats.accuracy * pairs / len(minibatch)])
                    step_loss, step_accuracy = global_sum(accelerator, shares).tolist()
                loss_sum += step_loss
                accuracy_sum += step_accuracy
                steps += 1
                if on_step is not None:
                    on_step(steps, {"loss": step_loss, "accuracy": step_accuracy})
            if on_epoch_end is not None:
                on_epoch_end(RewardTrainingProgress(epoch + 1, loss_sum, accuracy_sum, steps))
    check_weights(model, model="reward_model", learning_rate=config.learning_rate)
    # Every process evaluates every held-out pair (a small fraction), on the model without its DDP wrapper.
    held_out = evaluate_reward_model(accelerator.unwrap_model(model), eval_pairs, batch_size=config.batch_size)
    return RewardModelStats(
        train_loss=loss_sum / steps,
        train_accuracy=accuracy_sum / steps,
        eval_loss=held_out.loss,
        eval_accuracy=held_out.accuracy,
        score_mean=held_out.score_mean,
        score_std=held_out.score_std,
        optimizer_steps=steps,
        skipped_steps=skipped,
    )
