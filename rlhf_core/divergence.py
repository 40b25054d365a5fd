"""Divergence: a model whose loss, gradient norm, weights or logits stopped being finite.

A learning rate that is too high makes a real model diverge within a few optimizer steps. Unchecked,
the update saves non-finite (or huge) weights and the next generation samples from non-finite
probabilities, far from the cause (``index 259 is out of bounds``). So the training loops check
each loss before its backward pass and each gradient norm before its step, and their trained weights
once at the end; generation checks each step's logits. The first non-finite value raises
:class:`DivergenceError`, before anything is saved. One reduction per optimizer or decoding step.
"""

from __future__ import annotations

import torch
from torch import nn


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


@torch.no_grad()
def check_weights(module: nn.Module, *, model: str, learning_rate: float | None = None) -> None:
    """Raise :class:`DivergenceError` unless every trainable weight of ``module`` is finite."""
    for parameter in module.parameters():
        if parameter.requires_grad:
            check_finite(parameter, model=model, quantity="weights", learning_rate=learning_rate)
