"""Supervised fine-tuning (SFT): the policy learns to write the assistant's tokens of demonstrations.

The loss is :func:`sft_loss`; this module also owns the examples as tensors (:class:`SFTExamples`) and the training
loop (:func:`sft_update`). Which tokens are the assistant's is decided where the text is tokenised
(:mod:`tasks.sft_text`); here a ``loss_mask`` says so.

Choices:
1. An example is one right-padded row ``input_ids`` ``(T,)`` with its ``attention_mask`` and ``loss_mask`` (True on
   each token the model learns to write). Logits at column ``t`` score the token at ``t + 1``, so the first token of
   a row is never a target.
2. The loss is the mean negative log-likelihood over the assistant tokens of the whole minibatch (TRL's
   ``SFTTrainer`` with ``assistant_only_loss``: the token-mean over the batch, not a mean of per-example means), in
   fp32 whatever the forward's precision. Padding and the prompt's tokens are selected away with ``torch.where``,
   never multiplied by 0, so no value there (a nan included) reaches the loss.
3. Each epoch's order is a permutation drawn from a generator seeded by ``(seed, epoch)``, so a run resumed after any
   optimizer step (the caller checkpoints between steps: ``on_step_end``) draws the order the uninterrupted run drew
   and continues mid-epoch with the same minibatches.
4. Dropout is off (the models in train mode with every dropout probability at 0), as in every update here
   (:mod:`rlhf_core.ppo`, choice 2; :mod:`rlhf_core.dpo`, choice 3): a step's loss is a function of the weights.
5. With N processes (``accelerate launch``) each takes its share of every minibatch's rows; its loss is its share's
   summed NLL divided by the whole minibatch's assistant-token count, and each backpropagates N times it, so DDP's
   average of the gradients is the minibatch's (as the DPO update and the reward model's training do).
6. Packing (``packing``) changes how a minibatch is laid out, never which examples it holds: each process packs its
   share's examples whole into rows of at most ``packed_length`` tokens (None: the longest example, so no row is
   longer than an unpacked one), each attending only to itself (:mod:`rlhf_core.packing`). The steps, the order and
   the loss are the unpacked run's; the floats differ by rounding (another matmul shape), so packing is part of the
   stage's key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from accelerate import Accelerator

from rlhf_core.config import SFTConfig
from rlhf_core.distributed import rank_share
from rlhf_core.divergence import MAX_SKIPPED_STEPS, check_weights, share_step
from rlhf_core.models import dropout_disabled, fused_activations
from rlhf_core.packing import PackedRows, pack
from rlhf_core.sequences import logprobs_from_logits, position_ids_from_mask


def sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, *, tokens: int | None = None
) -> torch.Tensor:
    """The mean negative log-likelihood of the assistant's tokens (choice 2).

    Naive equivalent::

        nll = sum(-log_softmax(logits[b, t - 1])[input_ids[b, t]] for b, t if loss_mask[b, t] and t >= 1)
        loss = nll / (tokens or number of such (b, t))

    Args:
        logits: the model's logits of the rows (any dtype; computed in fp32).
        input_ids, loss_mask: the rows and their mask (True on each token learned).
        tokens: divide by this count instead of the rows' own assistant tokens: a process's share of a minibatch
            divides by the whole minibatch's (choice 5).

    Shapes:
        logits: (B, T, V); input_ids, loss_mask: (B, T); returns ().

    Raises:
        ValueError: no token to learn.
    """
    targets = loss_mask[:, 1:].bool()  # (B, T - 1): the token at t + 1 is scored by the logits at t
    count = int(targets.sum()) if tokens is None else tokens
    if count == 0:
        raise ValueError("the rows hold no assistant token to learn")
    logprobs = logprobs_from_logits(logits[:, :-1].float(), input_ids[:, 1:])  # (B, T - 1)
    nll = torch.where(targets, -logprobs, torch.zeros_like(logprobs))  # (B, T - 1)
    return nll.sum() / count


@dataclass(frozen=True)
class SFTExamples:
    """Tokenised examples, right-padded.

    Shapes:
        input_ids, attention_mask, loss_mask: (B, T).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("attention_mask", "loss_mask"):
            if getattr(self, name).shape != self.input_ids.shape:
                raise ValueError(
                    f"`{name}` must have shape {tuple(self.input_ids.shape)}, got {tuple(getattr(self, name).shape)}"
                )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def of(cls, rows: list[tuple[list[int], list[bool]]], *, pad_token_id: int) -> SFTExamples:
        """Rows of ``(input_ids, loss_mask)`` lists, right-padded with ``pad_token_id`` (masked out)."""
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, T)
        for row, (ids, mask) in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
            loss_mask[row, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
        return cls(input_ids, attention_mask, loss_mask)

    def select(self, rows: torch.Tensor) -> SFTExamples:
        """The examples ``rows`` (an index tensor), cut to their longest row."""
        width = max(int(self.attention_mask[rows].sum(dim=1).max()), 1)
        return SFTExamples(
            self.input_ids[rows, :width], self.attention_mask[rows, :width], self.loss_mask[rows, :width]
        )

    def to(self, device: torch.device | str) -> SFTExamples:
        return SFTExamples(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))

    @property
    def lengths(self) -> list[int]:
        """Each example's length in tokens (its row less the padding)."""
        return self.attention_mask.sum(dim=1).tolist()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments: the rows, their padding mask and positions."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": position_ids_from_mask(self.attention_mask),
        }

    def pack(self, length: int) -> PackedRows:
        """These examples packed whole into rows of at most ``length`` tokens (choice 6; :func:`rlhf_core.packing.pack`)."""
        return pack(self.input_ids, self.loss_mask, self.lengths, length=length)


def example_loss(
    model: torch.nn.Module, examples: SFTExamples | PackedRows, *, tokens: int | None = None
) -> torch.Tensor:
    """:func:`sft_loss` of ``examples`` under ``model`` (one forward pass, with grad where the model has it)."""
    logits = model(**examples.model_inputs(), use_cache=False).logits  # (B, T, V)
    return sft_loss(logits, examples.input_ids, examples.loss_mask, tokens=tokens)


class SFTProgress(NamedTuple):
    """Where an SFT run stands after an optimizer step: enough to continue it exactly after a crash (choice 3)."""

    steps_done: int
    loss_sum: float


class SFTStats(NamedTuple):
    """What an SFT run did: the mean of its steps' losses, its steps, and those fp16's loss scaler skipped."""

    train_loss: float
    optimizer_steps: int
    skipped_steps: int = 0


def optimizer_steps(examples: int, config: SFTConfig) -> int:
    """The optimizer steps of :func:`sft_update` on ``examples`` examples: ``epochs`` x ceil(examples / batch_size)."""
    return config.epochs * math.ceil(examples / config.batch_size)


def epoch_order(examples: int, *, seed: int, epoch: int) -> torch.Tensor:
    """The order of the examples in ``epoch`` (choice 3): a permutation drawn from ``(seed, epoch)`` alone.

    Shapes:
        returns (examples,).
    """
    return torch.randperm(examples, generator=torch.Generator().manual_seed((seed + epoch) % 2**63))


def minibatches(examples: int, config: SFTConfig, *, seed: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """``(step, the minibatch's example indices)`` of every optimizer step from ``start`` on: ``batch_size`` examples
    at a time in each epoch's order (choice 3).

    Shapes:
        yields (b,) indices, b <= batch_size.
    """
    steps_per_epoch = math.ceil(examples / config.batch_size)
    order, order_epoch = None, -1
    for step in range(start, optimizer_steps(examples, config)):
        epoch, index = divmod(step, steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(examples, seed=seed, epoch=epoch), epoch
        assert order is not None
        yield step, order[index * config.batch_size : (index + 1) * config.batch_size]


def packed_length(examples: SFTExamples, config: SFTConfig) -> int:
    """The longest packed row (choice 6): ``config.packed_length``, or the longest example."""
    return config.packed_length or max(examples.lengths)


def forward_rows(share: SFTExamples, config: SFTConfig, *, length: int) -> SFTExamples | PackedRows:
    """What one forward pass takes of a process's ``share`` of a minibatch: its rows, or with ``packing`` those rows
    packed into rows of at most ``length`` tokens (choice 6)."""
    return share.pack(length) if config.packing else share


def padding_share(examples: SFTExamples, config: SFTConfig, *, seed: int, world: int = 1) -> float:
    """The share of padding among the tokens that :func:`sft_update` forwards over its whole run on ``world``
    processes (their rows' cells that hold no example's token); no forward pass."""
    length, cells, tokens = packed_length(examples, config), 0, 0
    for _, minibatch in minibatches(len(examples), config, seed=seed):
        for rank in range(world):
            share, weight = rank_share(len(minibatch), rank=rank, world=world)
            if weight:
                rows = examples.select(minibatch[share])
                cells += forward_rows(rows, config, length=length).input_ids.numel()
                tokens += sum(rows.lengths)
    return (cells - tokens) / cells


def sft_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    examples: SFTExamples,
    config: SFTConfig,
    *,
    accelerator: Accelerator,
    seed: int,
    resume: SFTProgress | None = None,
    on_step_end: Callable[[SFTProgress], None] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    max_skipped_steps: int = MAX_SKIPPED_STEPS,
) -> SFTStats:
    """Train ``model`` for ``config.epochs`` epochs on ``examples``, ``config.batch_size`` examples an optimizer step,
    by :func:`sft_loss`.

    Args:
        model, optimizer: ``accelerator.prepare``d.
        examples: tokenised examples, each with at least one assistant token.
        config: the schedule.
        accelerator: drives backward passes and clipping.
        seed: each epoch's order derives from it (:func:`epoch_order`).
        resume: continue after ``resume.steps_done`` steps (mid-epoch too); the caller restores the model and
            optimizer states saved at that point.
        on_step_end: called after every optimizer step with the progress, e.g. to save a checkpoint.
        on_step: called after every optimizer step with the step number (from 1) and the minibatch's ``loss``.
        max_skipped_steps: under fp16's loss scaler, the steps it may skip in a row before training counts as
            diverged.

    Raises:
        ValueError: no examples.
    """
    if len(examples) == 0:
        raise ValueError("supervised fine-tuning needs at least one example")
    examples = examples.to(accelerator.device)
    length = packed_length(examples, config)
    steps, loss_sum = (resume.steps_done, resume.loss_sum) if resume else (0, 0.0)
    world, rank = accelerator.num_processes, accelerator.process_index
    in_a_row, skipped = 0, 0  # fp16's skipped steps: see rlhf_core.divergence
    with dropout_disabled(model), fused_activations(model):
        # 1. each step's minibatch: its place in its epoch's order (choice 3)
        for step, minibatch in minibatches(len(examples), config, seed=seed, start=steps):
            minibatch = minibatch.to(accelerator.device)
            tokens = int(examples.loss_mask[minibatch, 1:].sum())
            # 2. this process's share (packed: choice 6), divided by the whole minibatch's assistant tokens (choice 5)
            share, weight = rank_share(len(minibatch), rank=rank, world=world)
            rows = forward_rows(examples.select(minibatch[share.to(accelerator.device)]), config, length=length)
            loss = example_loss(model, rows, tokens=tokens)
            in_a_row, step_loss = share_step(
                accelerator, optimizer, model, loss, weight=weight, max_grad_norm=config.max_grad_norm,
                in_a_row=in_a_row, limit=max_skipped_steps,
                diverged={"model": "actor", "step": step + 1, "learning_rate": config.learning_rate},
            )  # fmt: skip
            skipped += in_a_row > 0
            loss_sum += step_loss
            if on_step is not None:
                on_step(step + 1, {"loss": step_loss})
            if on_step_end is not None:
                on_step_end(SFTProgress(step + 1, loss_sum))
    check_weights(model, model="actor", learning_rate=config.learning_rate)
    total = optimizer_steps(len(examples), config)
    return SFTStats(train_loss=loss_sum / total, optimizer_steps=total, skipped_steps=skipped)
