"""Divergence: a model whose loss, gradient norm, weights or logits stopped being finite.

A learning rate that is too high makes a real model diverge within a few optimizer steps. Unchecked,
the update saves non-finite (or huge) weights and the next generation samples from non-finite
probabilities, far from the cause (``index 259 is out of bounds``). So the training loops check
each loss before its backward pass and each gradient norm before its step, and their trained weights
once at the end; generation checks each step's logits. The first non-finite value raises
:class:`DivergenceError`, before anything is saved. One reduction per optimizer or decoding step.

Under fp16's loss scaler a non-finite gradient norm is no divergence: the scaled loss overflowed, and the scaler
skips the step and halves its scale (PyTorch's ``GradScaler``, what Accelerate drives). Only
:data:`MAX_SKIPPED_STEPS` skips in a row are (:func:`skipped_steps`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlhf_core.distributed import global_sum


class DivergenceError(ValueError):
    """A model's ``quantity`` (loss, gradient norm, weights, logits) is not finite.

    Attributes:
        model: ``actor``, ``critic`` or ``reward_model``: what diverged.
        quantity: what was found not finite.
        step: the optimizer step (from 1) it was found at, or None.
        learning_rate: the learning rate the model was trained with, where the check knows it.
    """

    def __init__(self, model: str, quantity: str, *, step: int | None = None, learning_rate: float | None = None):
        self.model, self.quantity, self.step, self.learning_rate = model, quantity, step, learning_rate
        where = f" at optimizer step {step}" if step is not None else ""
        rate = f" (learning rate {learning_rate:g})" if learning_rate is not None else ""
        verb = "are" if quantity in ("logits", "weights") else "is"
        super().__init__(f"the {model}'s {quantity} {verb} not finite{where}{rate}: it diverged")


def check_finite(
    value: torch.Tensor, *, model: str, quantity: str, step: int | None = None, learning_rate: float | None = None
) -> None:
    """Raise :class:`DivergenceError` unless every element of ``value`` is finite."""
    if not bool(torch.isfinite(value).all()):
        raise DivergenceError(model, quantity, step=step, learning_rate=learning_rate)


MAX_SKIPPED_STEPS = 16
"""Optimizer steps an fp16 loss scaler may skip in a row before the model counts as diverged: from the scale fp16
training starts at, 2^16 (PyTorch ``GradScaler``'s ``init_scale``; DeepSpeed's ``initial_scale_power`` 16), 16
halvings reach 1, DeepSpeed's default ``min_loss_scale``, where DeepSpeed stops a run ("Current loss scale already
at minimum"): past that an overflow is the model's, not the scale's. The default of ``ppo_update`` and
``fit_reward_model``'s ``max_skipped_steps``: not a config setting yet, because a new field of ``ppo`` or
``reward_model`` changes every finished iteration's run key and campaign fingerprint (the review's R9)."""


def skipped_steps(
    norm: torch.Tensor,
    *,
    scaled: bool,
    in_a_row: int,
    limit: int,
    model: str,
    step: int | None = None,
    learning_rate: float | None = None,
) -> int:
    """The optimizer steps skipped in a row after this one, whose gradient norm is ``norm``: 0 after a finite norm,
    one more after a non-finite one under a loss scaler (which skips that step).

    Args:
        scaled: a loss scaler drives the step (fp16); without one (fp32, bf16) a non-finite norm is a divergence.
        in_a_row: the steps skipped in a row before this one.
        limit: the skips in a row that count as a divergence (:data:`MAX_SKIPPED_STEPS` unless the caller says).

    Raises:
        DivergenceError: a non-finite norm without a scaler, or the ``limit``-th skip in a row.
    """
    if bool(torch.isfinite(norm).all()):
        return 0
    if not scaled:
        raise DivergenceError(model, "gradient norm", step=step, learning_rate=learning_rate)
    if in_a_row + 1 >= limit:
        quantity = f"gradient norm ({limit} steps in a row skipped by the fp16 loss scaler)"
        raise DivergenceError(model, quantity, step=step, learning_rate=learning_rate)
    return in_a_row + 1


@torch.no_grad()
def check_weights(module: nn.Module, *, model: str, learning_rate: float | None = None) -> None:
    """Raise :class:`DivergenceError` unless every trainable weight of ``module`` is finite."""
    for parameter in module.parameters():
        if parameter.requires_grad:
            check_finite(parameter, model=model, quantity="weights", learning_rate=learning_rate)


def guarded_step(
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    loss: torch.Tensor,
    *,
    scale: float,
    max_grad_norm: float,
    scaled: bool,
    in_a_row: int,
    limit: int,
    diverged: dict[str, Any],
) -> int:
    """One optimizer step of ``model`` on ``loss``, guarded: a non-finite loss stops training before the step
    (:func:`check_finite`), the gradient (of ``loss * scale``: a process's share of the minibatch, scaled so that
    DDP's average of the processes' gradients is the minibatch's) is clipped to ``max_grad_norm``, and a non-finite
    norm is a divergence, or under fp16's loss scaler (``scaled``) a step the scaler skips (:func:`skipped_steps`).
    The one home of the step every training loop takes (PPO's actor and critic, the reward model, DPO, SFT).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model`` and ``optimizer``.
        diverged: what a :class:`DivergenceError` names (``model``, ``step``, ``learning_rate``).

    Returns:
        The steps skipped in a row after this one.
    """
    check_finite(loss.detach(), quantity="loss", **diverged)
    optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss * scale)
    norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    in_a_row = skipped_steps(torch.as_tensor(norm), scaled=scaled, in_a_row=in_a_row, limit=limit, **diverged)
    optimizer.step()
    return in_a_row


def share_step(
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    loss: torch.Tensor,
    *,
    weight: float,
    max_grad_norm: float,
    in_a_row: int,
    limit: int,
    diverged: dict[str, Any],
) -> tuple[int, float]:
    """:func:`guarded_step` on this process's share of a minibatch, whose ``loss`` is already divided by the whole
    minibatch's count (``weight`` 0 for a share with no real rows, :func:`rlhf_core.distributed.rank_share`): each
    process backpropagates N times its share, so DDP's average of the gradients is the minibatch's. The step of the
    loops that split minibatches by rows (DPO, SFT).

    Returns:
        The steps skipped in a row after this one, and the whole minibatch's loss (the sum of the shares').
    """
    in_a_row = guarded_step(
        accelerator, optimizer, model, loss, scale=accelerator.num_processes * weight, max_grad_norm=max_grad_norm,
        scaled=accelerator.scaler is not None, in_a_row=in_a_row, limit=limit, diverged=diverged,
    )  # fmt: skip
    return in_a_row, global_sum(accelerator, loss.detach() * weight).item()
