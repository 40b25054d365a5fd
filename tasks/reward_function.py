"""Reward functions reached by name (``reward.function: module:callable``): programmatic, "verifiable" rewards.

A reward function is a callable ``(prompt: str, response: str) -> float``, e.g. the demo's hidden
gold rubric ``demo.gold:gold_score``, a unit-test runner or an answer checker. With
``reward.source: function`` it scores the rollouts in place of a learned reward model.

Choices:
1. As a stage setting it is keyed by its name and the fingerprint of its module's code (as a
   judge is, :class:`tasks.judge.JudgeReference`), so editing the function re-runs what it scored.
2. A function that raises, or returns anything but a finite number, fails the stage with the
   prompt's id in the message: a silent 0 or NaN would train the policy on a broken reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.code import code_fingerprint
from tasks.judge import load_object

if TYPE_CHECKING:
    import torch

RewardFunction = Callable[[str, str], float]


def load_reward_function(reference: str) -> RewardFunction:
    """The callable that ``reference`` (``module:attribute``) names.

    Raises:
        ValueError: it cannot be loaded, or is not callable.
    """
    function = load_object(reference)
    if not callable(function):
        raise ValueError(
            f"{reference!r} is not a reward function: it must be callable as `(prompt, response) -> float`"
        )
    return function  # type: ignore[return-value]


@dataclass(frozen=True)
class RewardFunctionReference:
    """A reward function by name (``module:attribute``) and the fingerprint of its module's code."""

    name: str
    code: str

    @classmethod
    def of(cls, name: str) -> RewardFunctionReference:
        """The reference to ``name``, checked to load as a callable.

        Raises:
            ValueError: see :func:`load_reward_function`.
        """
        load_reward_function(name)
        return cls(name=name, code=code_fingerprint(name.partition(":")[0]))

    def load(self) -> RewardFunction:
        return load_reward_function(self.name)


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than a finite number."""


def score_texts(
    function: RewardFunction, name: str, prompts: Sequence[str], responses: Sequence[str], prompt_ids: Sequence[int]
) -> torch.Tensor:
    """``function(prompt, response)`` for each row, as float32 scores.

    Args:
        function: the reward function.
        name: its ``module:attribute`` name, for error messages.
        prompts, responses, prompt_ids: one per row; ``prompt_ids`` name the rows in errors.

    Shapes:
        returns (B,).

    Raises:
        RewardFunctionError: the function raised, or returned a non-number or a non-finite value;
            the message names the prompt's id.
    """
    import torch  # here, not at the top: naming a reward function (a run key, a reuse check) needs no torch

    scores = []
    for prompt, response, prompt_id in zip(prompts, responses, prompt_ids, strict=True):
        try:
            value = function(prompt, response)
        except Exception as error:
            raise RewardFunctionError(
                f"reward function {name} raised on prompt {prompt_id} ({prompt!r}, response {response!r}): {error!r}"
            ) from error
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function {name} returned {value!r} for prompt {prompt_id} ({prompt!r}, response "
                f"{response!r}): it must return a finite number"
            )
        scores.append(float(value))
    return torch.tensor(scores, dtype=torch.float32)
