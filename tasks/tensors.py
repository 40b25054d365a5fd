"""Token lists as the tensors models read, and reward-model scores of them: the torch half of :mod:`tasks.text`.

1. Prompts are left-padded, the layout every ``rlhf_core`` function assumes, whatever the tokenizer's own padding
   side; conversations for a reward model are right-padded (it reads the last real token, so either side works).
2. A reward model scores responses in its own tokens (:class:`RewardScorer`): the policy's ids as they are where
   the two tokenizers are the same, else the prompt and the decoded response re-rendered
   (:func:`tasks.text.conversation_id_lists`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.dpo import PreferencePairs
from tasks.text import Prompt, conversation_id_lists, decode, load_tokenizer, prompt_ids, same_tokenizer


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask.

    Shapes:
        returns (B, P) long and (B, P) long.
    """
    rows = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    return pad_token_lists(rows, pad_token_id=tokenizer.pad_token_id, side="left")


def prompt_token_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The unpadded prompt ids of each row. Shapes: prompt_ids, prompt_mask: (B, P)."""
    return [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask, strict=True)]


def response_token_lists(sequences: torch.Tensor, action_mask: torch.Tensor) -> list[list[int]]:
    """The action tokens of each row. Shapes: sequences: (B, T); action_mask: (B, R)."""
    responses = sequences[:, sequences.shape[1] - action_mask.shape[1] :]  # (B, R)
    return [row[mask].tolist() for row, mask in zip(responses.cpu(), action_mask.cpu(), strict=True)]


def pad_token_lists(
    rows: Sequence[Sequence[int]], *, pad_token_id: int, side: Literal["left", "right"] = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to one width: on the left for prompts a model continues, on the right where either side
    works (a reward model reads the last real token).

    Shapes:
        returns (B, T) long ids and (B, T) long mask.
    """
    width = max(1, max((len(row) for row in rows), default=1))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            columns = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            ids[index, columns] = torch.tensor(list(row), dtype=torch.long)
            mask[index, columns] = 1
    return ids, mask


def preference_pairs(
    prompt_lists: Sequence[Sequence[int]],
    chosen_lists: Sequence[Sequence[int]],
    rejected_lists: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
) -> PreferencePairs:
    """Pairs as a DPO update reads them: prompts left-padded, both responses right-padded to one width R.

    Shapes:
        returns :class:`rlhf_core.dpo.PreferencePairs` of B pairs, prompts (B, P), responses (B, R).
    """
    prompt_ids, prompt_mask = pad_token_lists(prompt_lists, pad_token_id=pad_token_id, side="left")  # (B, P)
    responses, masks = pad_token_lists([*chosen_lists, *rejected_lists], pad_token_id=pad_token_id)  # (2B, R)
    pairs = len(prompt_lists)
    return PreferencePairs(prompt_ids, prompt_mask, responses[:pairs], masks[:pairs], responses[pairs:], masks[pairs:])


class RewardScorer:
    """Scores responses with a reward model, in the reward model's own tokens.

    The caller puts the model in eval mode and the stage's autocast around the calls.

    Args:
        model: the reward model (``(ids, mask) -> (B,)``).
        policy_tokenizer, reward_tokenizer: the tokenizers of the policy and of the reward model.
        same_tokens: the two tokenizers are the same (by content): the policy's ids are scored as they are, but for
            chat prompts under a template (see :meth:`_scores_policy_ids`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_tokenizer: PreTrainedTokenizerBase,
        same_tokens: bool,
    ) -> None:
        self.model = model
        self.policy_tokenizer = policy_tokenizer
        self.reward_tokenizer = reward_tokenizer
        self.same_tokens = same_tokens

    def _scores_policy_ids(self, prompts: Sequence[Prompt]) -> bool:
        """Whether the policy's own ids are what the reward model reads, as it did in training
        (:func:`conversation_id_lists`): with the same tokenizer, except for chat prompts under a chat template, whose
        conversation training renders whole through the template (its end-of-turn text after the response
        included), so scoring renders them the same way instead of reading the generated ids."""
        chat = bool(self.reward_tokenizer.chat_template) and any(prompt.messages for prompt in prompts)
        return self.same_tokens and not chat

    @torch.no_grad()
    def score(
        self, prompts: Sequence[Prompt], sequences: torch.Tensor, attention_mask: torch.Tensor, *, prompt_length: int
    ) -> torch.Tensor:
        """Scores of generated responses to ``prompts``.

        Shapes:
            sequences, attention_mask: (B, T) policy tokens, ``[left-padded prompt | right-padded response]``;
            returns (B,) float32 on the model's device.
        """
        if self._scores_policy_ids(prompts):
            device = next(self.model.parameters()).device
            return self.model(sequences.to(device), attention_mask.to(device)).float()
        action_mask = attention_mask[:, prompt_length:].bool()  # (B, R)
        responses = decode(self.policy_tokenizer, response_token_lists(sequences, action_mask))
        return self.score_texts(prompts, responses)

    @torch.no_grad()
    def score_candidates(
        self, prompts: Sequence[Prompt], token_lists: Sequence[Sequence[int]], responses: Sequence[str]
    ) -> torch.Tensor:
        """Scores of candidates kept as full policy token lists (prompt + response) and as response text.

        Shapes: returns (B,).
        """
        if not self._scores_policy_ids(prompts):
            return self.score_texts(prompts, responses)
        ids, mask = pad_token_lists(token_lists, pad_token_id=self.policy_tokenizer.pad_token_id)
        device = next(self.model.parameters()).device
        return self.model(ids.to(device), mask.to(device)).float()

    @torch.no_grad()
    def score_texts(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        """Scores of text responses, rendered as conversations in the reward model's tokens. Shapes: returns (B,)."""
        rows = conversation_id_lists(self.reward_tokenizer, prompts, responses)
        ids, mask = pad_token_lists(rows, pad_token_id=self.reward_tokenizer.pad_token_id)
        device = next(self.model.parameters()).device
        return self.model(ids.to(device), mask.to(device)).float()


def reward_scorer(model: torch.nn.Module, *, policy_tokenizer_dir: str, reward_tokenizer_dir: str) -> RewardScorer:
    """A :class:`RewardScorer` for a reward model with the tokenizer in ``reward_tokenizer_dir``."""
    policy_tokenizer = load_tokenizer(policy_tokenizer_dir)
    reward_tokenizer = load_tokenizer(reward_tokenizer_dir)
    return RewardScorer(
        model,
        policy_tokenizer=policy_tokenizer,
        reward_tokenizer=reward_tokenizer,
        same_tokens=same_tokenizer(policy_tokenizer, reward_tokenizer),
    )
