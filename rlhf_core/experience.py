"""Experience: one batch of PPO rollouts, with every field's shape written down.

Rollout (stage 4) fills the first block; compute advantages (stage 5) fills ``rewards``, ``kl``,
``advantages`` and ``returns``. ``group_ids`` names the prompt each row answers: the rows of one
prompt are the group that GRPO and RLOO compare (:mod:`rlhf_core.advantages`); on disk it is the
``prompt_id`` column. ``old_values`` is None for a rollout made without a critic. The ``old_`` prefix marks rollout-time quantities of the models
being trained (``old_logprobs``, ``old_values``), against the current ones the update computes;
``ref_logprobs`` come from the frozen reference policy. The same names are the Parquet columns
(:mod:`storage.schemas`) and the arguments of the maths. ``policy_versions`` names the policy that sampled each row
(the number of updates behind it), so how stale a row is to an update is a query (:mod:`rlhf_core.off_policy`);
``prox_logprobs`` is the update's own: the log-probs of the policy it starts from, for decoupled PPO.

A multi-turn episode (:mod:`rlhf_core.episodes`) is one row too: its response window holds the model's turns and the
environment's replies between them (the response half of ``attention_mask`` covers both), ``action_mask`` is True at
the model's tokens only (gaps at the environment's), and ``turn_rewards`` holds each model turn's reward.

An Experience is immutable: :meth:`Experience.to`, :meth:`Experience.select` and
:meth:`Experience.replace` return new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "old_values", "engine_logprobs")
"""Per-token (B, R) fields a rollout fills."""
UPDATE_FIELDS = ("prox_logprobs",)
"""Per-token (B, R) fields the PPO update fills for itself (never stored)."""
SCORED_FIELDS = ("rewards", "kl", "advantages", "returns")
"""Per-token (B, R) fields stage 5 fills, all together."""


@dataclass(frozen=True)
class Experience:
    """A batch of rollouts.

    Shapes (legend in :mod:`rlhf_core`):
        sequences: (B, T) long, ``[left-padded prompt | right-padded response]``.
        attention_mask: (B, T) long, 1 for real prompt tokens and actions.
        action_mask: (B, R) bool, True for generated tokens up to and including EOS: the model's tokens, the loss
            mask (an episode's has a gap at each environment reply; all False for an episode kept out of the loss).
        old_logprobs: (B, R) float, log-probs of the actions under the rollout policy.
        ref_logprobs: (B, R) float, log-probs under the frozen reference policy.
        old_values: (B, R) float or None, critic values of the state before each action, at rollout
            time; None when the rollout had no critic (critic-free estimators).
        scores: (B,) float, reward score of each sequence.
        rewards: (B, R) float or None, shaped per-token reward.
        kl: (B, R) float or None, per-token KL estimate (in ``rewards`` when the KL acts there).
        advantages: (B, R) float or None, advantages (GAE's not whitened).
        returns: (B, R) float or None, critic targets (GAE) or the reward-to-go (critic-free).
        group_ids: (B,) integer or None, the prompt (group) of each row.
        engine_logprobs: (B, R) float or None, log-probs of the actions as the sampler computed them (vLLM's,
            or the project's own decode loop); ``old_logprobs`` are the trainer's, and what PPO uses.
        policy_versions: (B,) integer or None, the version of the policy that sampled each row (the updates behind
            it: 0 for the initial policy); None for experience written before versions were kept (all on-policy).
        prox_logprobs: (B, R) float or None, the log-probs of the actions under the policy a PPO update starts from
            (decoupled PPO's pi_prox, :mod:`rlhf_core.off_policy`); None: the update's ratio starts from
            ``old_logprobs``.
        turn_rewards: (B, N) float or None, the reward of each model turn of an episode, zero-padded to the most
            turns N; ``scores`` is their sum. None for single-turn rollouts.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor | None
    scores: torch.Tensor
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None
    policy_versions: torch.Tensor | None = None
    prox_logprobs: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None

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
    def device(self) -> torch.device:
        return self.sequences.device

    @property
    def is_scored(self) -> bool:
        """True once rewards, KL, advantages and returns are filled in."""
        return all(getattr(self, name) is not None for name in SCORED_FIELDS)

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
        expected = {
            "attention_mask": (batch, total),
            "action_mask": (batch, response),
            "scores": (batch,),
            "group_ids": (batch,),
            "policy_versions": (batch,),
        }
        expected.update({name: (batch, response) for name in TOKEN_FIELDS + SCORED_FIELDS + UPDATE_FIELDS})
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"`{name}` must have shape {shape}, got {tuple(value.shape)}")
        turns = self.turn_rewards
        if turns is not None and (turns.dim() != 2 or turns.shape[0] != batch):
            raise ValueError(f"`turn_rewards` must have shape ({batch}, N), got {tuple(turns.shape)}")
        if self.action_mask.dtype != torch.bool:
            raise ValueError(f"`action_mask` must be bool, got {self.action_mask.dtype}")
        for name in ("group_ids", "policy_versions"):
            value = getattr(self, name)
            if value is not None and (value.is_floating_point() or value.dtype == torch.bool):
                raise ValueError(f"`{name}` must be integers, got {value.dtype}")
        filled = [getattr(self, name) is not None for name in SCORED_FIELDS]
        if any(filled) and not all(filled):
            raise ValueError(f"{', '.join(SCORED_FIELDS)} must be set together")

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def to(self, device: torch.device | str) -> Experience:
        """A new Experience with every tensor on ``device`` (self when they are there already)."""
        device = torch.device(device)
        if self.sequences.device == device:
            return self
        return Experience(
            **{name: None if value is None else value.to(device) for name, value in self._tensors().items()}
        )

    def select(self, rows: torch.Tensor) -> Experience:
        """A new Experience holding only ``rows`` (a (k,) index tensor, on any device)."""
        rows = rows.to(self.device)
        return Experience(**{name: None if value is None else value[rows] for name, value in self._tensors().items()})

    def replace(self, **changes: torch.Tensor | None) -> Experience:
        """A new Experience with some fields replaced (validated)."""
        return dataclasses.replace(self, **changes)

    def minibatches(self, size: int, *, generator: torch.Generator | None = None) -> Iterator[Experience]:
        """Shuffle the rows and yield minibatches of ``size`` rows; every row appears exactly once.

        The shuffle is drawn on the CPU (``generator`` is a CPU generator), so the same seed gives
        the same minibatches on any device. The last minibatch is smaller when ``size`` does not
        divide the batch.
        """
        if size <= 0:
            raise ValueError(f"`size` must be positive, got {size}")
        order = torch.randperm(self.batch_size, generator=generator)
        for start in range(0, self.batch_size, size):
            yield self.select(order[start : start + size])
