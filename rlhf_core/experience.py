"""Experience: one batch of PPO rollouts, with every field's shape written down.

Rollout (stage 4) fills the first block; compute advantages (stage 5) fills ``reward``, ``kl``,
``advantages`` and ``returns``. Field names follow ColossalChat's ``Experience``; the additions
are what an offline replay needs (reference log-probs, sequence scores, returns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_TOKEN_FIELDS = ("action_log_probs", "ref_log_probs", "values")
_SCORED_FIELDS = ("reward", "kl", "advantages", "returns")


@dataclass
class Experience:
    """A batch of rollouts.

    Shapes (legend in :mod:`rlhf_core`):
        sequences: (B, T) long, ``[left-padded prompt | right-padded response]``.
        attention_mask: (B, T) long, 1 for real prompt tokens and actions.
        action_mask: (B, R) bool, True for generated tokens up to and including EOS.
        action_log_probs: (B, R) float, log-probs of the actions under the rollout policy.
        ref_log_probs: (B, R) float, log-probs under the frozen reference policy.
        values: (B, R) float, critic values of the state before each action.
        scores: (B,) float, reward-model score of each sequence.
        reward: (B, R) float or None, shaped per-token reward.
        kl: (B, R) float or None, per-token KL estimate used in ``reward``.
        advantages: (B, R) float or None, GAE advantages (not whitened).
        returns: (B, R) float or None, critic targets.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    action_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    reward: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_length(self) -> int:
        return self.action_mask.shape[1]

    @property
    def prompt_length(self) -> int:
        return self.sequences.shape[1] - self.response_length

    @property
    def is_scored(self) -> bool:
        """True once rewards, KL, advantages and returns are filled in."""
        return all(getattr(self, name) is not None for name in _SCORED_FIELDS)

    def validate(self) -> None:
        """Check every field's shape and dtype against ``(B, T)``, ``(B, R)`` and ``(B,)``."""
        if self.sequences.dim() != 2 or self.action_mask.dim() != 2:
            raise ValueError(
                f"`sequences` and `action_mask` must be 2-D, got {tuple(self.sequences.shape)} and "
                f"{tuple(self.action_mask.shape)}"
            )
        batch, total = self.sequences.shape
        response = self.action_mask.shape[1]
        if response >= total:
            raise ValueError(f"`action_mask` length {response} must be shorter than `sequences` length {total}")
        expected = {"attention_mask": (batch, total), "action_mask": (batch, response), "scores": (batch,)}
        expected.update({name: (batch, response) for name in _TOKEN_FIELDS + _SCORED_FIELDS})
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"`{name}` must have shape {shape}, got {tuple(value.shape)}")
        if self.action_mask.dtype != torch.bool:
            raise ValueError(f"`action_mask` must be bool, got {self.action_mask.dtype}")
        filled = [getattr(self, name) is not None for name in _SCORED_FIELDS]
        if any(filled) and not all(filled):
            raise ValueError(f"{', '.join(_SCORED_FIELDS)} must be set together")

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @torch.no_grad()
    def to_device(self, device: torch.device | str) -> None:
        """Move every tensor to ``device`` in place."""
        for name, value in self._tensors().items():
            if value is not None:
                setattr(self, name, value.to(device))

    def pin_memory(self) -> Experience:
        """Pin every tensor's memory in place (for faster host-to-device copies); returns self."""
        for name, value in self._tensors().items():
            if value is not None:
                setattr(self, name, value.pin_memory())
        return self

    def select(self, rows: torch.Tensor) -> Experience:
        """A new Experience holding only ``rows`` (a (k,) index tensor)."""
        return Experience(**{name: None if value is None else value[rows] for name, value in self._tensors().items()})

    def replace(self, **changes: torch.Tensor | None) -> Experience:
        """A new Experience with some fields replaced (validated)."""
        return dataclasses.replace(self, **changes)

    def minibatches(self, size: int, *, generator: torch.Generator | None = None) -> Iterator[Experience]:
        """Shuffle the rows and yield minibatches of ``size`` rows; every row appears exactly once.

        The last minibatch is smaller when ``size`` does not divide the batch.
        """
        if size <= 0:
            raise ValueError(f"`size` must be positive, got {size}")
        order = torch.randperm(self.batch_size, generator=generator)
        for start in range(0, self.batch_size, size):
            yield self.select(order[start : start + size])


def concat_experience(parts: list[Experience], *, pad_token_id: int) -> Experience:
    """Stack batches whose prompt and response lengths may differ, re-padding to the longest.

    Prompts are left-padded with ``pad_token_id`` (attention 0); responses are right-padded
    (attention 0, action mask False, float fields 0).
    """
    if not parts:
        raise ValueError("`parts` is empty")
    scored = [part.is_scored for part in parts]
    if any(scored) and not all(scored):
        raise ValueError("`parts` mixes scored and unscored experience: the scored fields would be lost")
    prompt_length = max(part.prompt_length for part in parts)
    response_length = max(part.response_length for part in parts)
    fields: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        extra_prompt = prompt_length - part.prompt_length
        extra_response = response_length - part.response_length
        pad_sequence = torch.nn.functional.pad
        fields.setdefault("sequences", []).append(
            pad_sequence(part.sequences, (extra_prompt, extra_response), value=pad_token_id)
        )
        fields.setdefault("attention_mask", []).append(
            pad_sequence(part.attention_mask, (extra_prompt, extra_response))
        )
        fields.setdefault("scores", []).append(part.scores)
        for name in ("action_mask", *_TOKEN_FIELDS, *_SCORED_FIELDS):
            value = getattr(part, name)
            if value is not None:
                fields.setdefault(name, []).append(pad_sequence(value, (0, extra_response)))
    merged = {name: torch.cat(values) for name, values in fields.items() if len(values) == len(parts)}
    return Experience(**merged)
