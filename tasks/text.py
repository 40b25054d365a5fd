"""Text in and out of token ids for the stage tasks: prompts, responses, preference pairs.

Choices:
1. Prompts are tokenised with the tokenizer's own special tokens (a BOS where the model expects
   one) and left-padded, the layout every ``rlhf_core`` function assumes.
2. A response's text is decoded from its action tokens without special tokens; its token ids
   are kept beside it wherever the pipeline generated them, so the reward model sees exactly
   what the policy produced.
3. A pair imported as text is tokenised as prompt ids + response ids + EOS.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from storage.checkpoints import load_tokenizer as load_saved_tokenizer
from storage.importers import import_prompts


def load_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, left-padded, with a pad token (EOS when it has none).

    Each call loads a fresh object: a fast tokenizer keeps the padding settings of its last call,
    and a checkpoint must never save state that depends on what ran before in the process.
    """
    tokenizer = load_saved_tokenizer(Path(directory))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer in {directory} has neither a pad nor an EOS token; set one")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask.

    Shapes:
        returns (B, P) long and (B, P) long.
    """
    encoded = tokenizer(list(prompts), padding=True, return_tensors="pt", add_special_tokens=True)
    return encoded["input_ids"], encoded["attention_mask"]


def prompt_token_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The unpadded prompt ids of each row. Shapes: prompt_ids, prompt_mask: (B, P)."""
    return [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask, strict=True)]


def response_token_lists(sequences: torch.Tensor, action_mask: torch.Tensor) -> list[list[int]]:
    """The action tokens of each row. Shapes: sequences: (B, T); action_mask: (B, R)."""
    responses = sequences[:, sequences.shape[1] - action_mask.shape[1] :]  # (B, R)
    return [row[mask].tolist() for row, mask in zip(responses, action_mask, strict=True)]


def decode(tokenizer: PreTrainedTokenizerBase, token_lists: Sequence[Sequence[int]]) -> list[str]:
    """Readable text of each token list, special tokens dropped."""
    return [tokenizer.decode(list(tokens), skip_special_tokens=True).strip() for tokens in token_lists]


def encode_response(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str) -> list[int]:
    """Token ids of ``prompt`` + ``response`` + EOS, for a pair that arrived as text."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(" " + response if response else "", add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return list(prompt_ids) + list(response_ids) + eos


def pad_token_lists(rows: Sequence[Sequence[int]], *, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists (the reward model reads the last real token, so either side works).

    Shapes:
        returns (B, T) long ids and (B, T) long mask.
    """
    width = max(1, max((len(row) for row in rows), default=1))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[index, : len(row)] = 1
    return ids, mask


def batches(count: int, size: int) -> Iterator[slice]:
    """Consecutive slices of ``size`` covering ``range(count)``."""
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def read_prompt_texts(path: str | Path) -> list[str]:
    """Prompts from a JSONL, Parquet or CSV file (see :func:`storage.importers.import_prompts`)."""
    return import_prompts(Path(path)).column("prompt").to_pylist()


def rotating_subset(items: Sequence[str], *, count: int, iteration: int, offset: int = 0) -> list[tuple[int, str]]:
    """``count`` items starting where the previous iteration stopped, wrapping around: ``(index, item)``."""
    if not items:
        raise ValueError("no prompts to choose from")
    start = iteration * count + offset
    return [((start + k) % len(items), items[(start + k) % len(items)]) for k in range(count)]
