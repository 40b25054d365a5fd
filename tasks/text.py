"""Text in and out of token ids for the stage tasks and the input checks: prompts, conversations, responses.

One rendering, used the same way by every stage (sampling, preference pairs, reward-model
training and scoring, rollout, evaluation) and by the checks that refuse a prompt before anything runs
(:mod:`flows.inputs`):

1. A :class:`Prompt` is plain text or chat turns. Plain text is tokenised with the tokenizer's own
   special tokens (a BOS where the model expects one). Chat turns go through the tokenizer's chat
   template with its generation prompt; a tokenizer without a template gets the plain Anthropic HH
   format (:func:`storage.importers.render_chat`).
2. A conversation (a prompt and a response) for a reward model is rendered through the reward
   model's own tokenizer the same way: the template with the response as the final assistant turn,
   or, for a plain prompt (or no template), prompt ids + the response's ids + EOS.
3. A response's text is decoded from its action tokens without special tokens; its token ids are
   kept beside it wherever the pipeline generated them, so a reward model with the policy's
   tokenizer sees exactly what the policy produced. A reward model with another tokenizer sees the
   prompt and the decoded response re-rendered in its own tokens (:class:`tasks.tensors.RewardScorer`).

This module imports no torch (nor does a generic fast tokenizer, :mod:`storage.tokenizers`), so the input checks
tokenise every prompt by these rules before torch is imported; token lists become tensors in :mod:`tasks.tensors`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from storage.importers import import_prompts, prompt_columns, render_chat
from storage.schemas import MESSAGES, PROMPT
from storage.tokenizers import load_tokenizer as load_saved_tokenizer

logger = logging.getLogger(__name__)


class Prompt(NamedTuple):
    """A prompt: its text (for a chat prompt, a readable rendering of its turns), its chat turns (empty for a
    plain-text prompt) and the other columns of its row in the prompts file (what a reward function receives
    beside it, :mod:`tasks.reward_function`; empty where the prompt was not read from a prompts file)."""

    text: str
    messages: tuple[dict[str, str], ...] = ()
    columns: Mapping[str, Any] = MappingProxyType({})


def load_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """A tokenizer, left-padded, with a pad token (EOS when it has none, said once in the log).

    Each call loads a fresh object: a fast tokenizer keeps the padding settings of its last call,
    and a checkpoint must never save state that depends on what ran before in the process.
    """
    tokenizer = load_saved_tokenizer(Path(directory))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer in {directory} has neither a pad nor an EOS token; set one")
        tokenizer.pad_token = tokenizer.eos_token
        _say_once(f"the tokenizer in {directory} has no pad token: padding with its EOS token {tokenizer.eos_token!r}")
    return tokenizer


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


def prompts_of(table: pa.Table) -> list[Prompt]:
    """The prompts of a table with ``prompt`` and ``messages`` columns (prompts, candidates, preferences)."""
    return [
        Prompt(text, tuple(messages))
        for text, messages in zip(table.column(PROMPT).to_pylist(), table.column(MESSAGES).to_pylist(), strict=True)
    ]


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL, Parquet or CSV file or a ``datasets`` folder (see :func:`storage.importers.import_prompts`),
    each with the other columns of its row."""
    prompts = prompts_of(import_prompts(Path(path)))
    columns = prompt_columns(Path(path))
    return [prompt._replace(columns=MappingProxyType(row)) for prompt, row in zip(prompts, columns, strict=True)]


def _templated(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> bool:
    return bool(prompt.messages and tokenizer.chat_template)


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """``prompt`` as the model sees it, as text (module docstring, 1): a chat prompt through the tokenizer's chat
    template with its generation prompt, or the HH format without a template; a plain prompt as it is."""
    if _templated(tokenizer, prompt):
        return tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
    return render_chat(list(prompt.messages), add_generation_prompt=True) if prompt.messages else prompt.text


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """The token ids a model is given for ``prompt`` (see the module docstring, 1); a chat template writes any BOS
    itself, plain text gets the tokenizer's own special tokens."""
    text = prompt_text(tokenizer, prompt)
    return list(tokenizer(text, add_special_tokens=not _templated(tokenizer, prompt))["input_ids"])


def conversation_id_lists(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], responses: Sequence[str]
) -> list[list[int]]:
    """The token ids of each ``prompts[i]`` answered by ``responses[i]``, for a reward model (module docstring,
    2), tokenised in batches: a fast tokenizer encodes a batch in one call, where a call per conversation spends
    much of its time around the tokenizer (1.6-2x faster on 3000 short conversations here, with and without a
    template)."""
    rows: list[list[int]] = [[] for _ in prompts]
    templated, plain = [], []
    for index, prompt in enumerate(prompts):
        (templated if prompt.messages and tokenizer.chat_template else plain).append(index)
    texts = [
        tokenizer.apply_chat_template(
            [*prompts[i].messages, {"role": "assistant", "content": responses[i]}], tokenize=False
        )
        for i in templated
    ]
    for index, ids in zip(templated, _token_lists(tokenizer, texts, special_tokens=False), strict=True):
        rows[index] = ids  # the template writes any BOS and end-of-turn itself
    prompt_texts = [
        render_chat(list(prompts[i].messages), add_generation_prompt=True) if prompts[i].messages else prompts[i].text
        for i in plain
    ]
    response_texts = [" " + responses[i] if responses[i] else "" for i in plain]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for index, prompt_part, response_part in zip(
        plain,
        _token_lists(tokenizer, prompt_texts, special_tokens=True),
        _token_lists(tokenizer, response_texts, special_tokens=False),
        strict=True,
    ):
        rows[index] = prompt_part + response_part + eos
    return rows


def turn_end(tokenizer: PreTrainedTokenizerBase, turn: Sequence[int]) -> int | None:
    """Where an assistant turn's ids end: one past its last token of the tokenizer's added vocabulary (the end of
    turn, ``<|im_end|>``), leaving out the whitespace a template writes after it; None where it has none. The one rule
    for what the model emits of a turn (:mod:`tasks.sft_text` masks it, :func:`response_id_lists` cuts it)."""
    added = set(tokenizer.get_added_vocab().values())
    ends = [index for index, token in enumerate(turn) if token in added]
    return ends[-1] + 1 if ends else None


def response_id_lists(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], responses: Sequence[str]
) -> tuple[list[list[int]], list[list[int]]]:
    """The ids of each ``prompts[i]`` as the policy is given it (:func:`prompt_ids`) and of ``responses[i]`` after it,
    rendered as :func:`conversation_id_lists` renders the pair for a reward model (module docstring, 2): the
    response's tokens run through its end of turn (EOS for a plain prompt; the template's end-of-turn token, its last
    added token, without the whitespace a template writes after it, as :mod:`tasks.sft_text` masks an assistant turn).

    Raises:
        ValueError: a conversation whose rendering does not start with its prompt's ids (a chat template that renders
            the turns before the answer otherwise once it follows), or a response with no token.
    """
    prompt_lists, response_lists = [], []
    for index, (prompt, whole) in enumerate(
        zip(prompts, conversation_id_lists(tokenizer, prompts, responses), strict=True)
    ):
        start = prompt_ids(tokenizer, prompt)
        if whole[: len(start)] != start:
            raise ValueError(
                f"pair {index}: the prompt's ids are no prefix of the conversation's (the chat template renders the "
                "turns before the answer otherwise once it follows): its response's tokens cannot be told apart"
            )
        response = whole[len(start) :]
        if _templated(tokenizer, prompt) and (end := turn_end(tokenizer, response)) is not None:
            response = response[:end]
        if not response:
            raise ValueError(f"pair {index}: the response has no token (the tokenizer has no EOS token to end it)")
        prompt_lists.append(start)
        response_lists.append(response)
    return prompt_lists, response_lists


def _token_lists(tokenizer: PreTrainedTokenizerBase, texts: list[str], *, special_tokens: bool) -> list[list[int]]:
    """The ids of each text, in one tokenizer call."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]]


def decode(tokenizer: PreTrainedTokenizerBase, token_lists: Sequence[Sequence[int]]) -> list[str]:
    """Readable text of each token list, special tokens dropped."""
    return [tokenizer.decode(list(tokens), skip_special_tokens=True).strip() for tokens in token_lists]


def batches(count: int, size: int) -> Iterator[slice]:
    """Consecutive slices of ``size`` covering ``range(count)``."""
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def rotating_subset(items: Sequence, *, count: int, iteration: int, offset: int = 0) -> list[tuple[int, object]]:
    """``count`` items starting where the previous iteration stopped, wrapping around: ``(index, item)``."""
    if not items:
        raise ValueError("no prompts to choose from")
    start = iteration * count + offset
    return [((start + k) % len(items), items[(start + k) % len(items)]) for k in range(count)]


def round_prompts(prompts: Sequence, *, count: int, iteration: int, round_index: int) -> list[tuple[int, object]]:
    """The ``(prompt_id, prompt)`` of round ``round_index`` of an iteration (``sizes.decisive_pairs``): the
    ``round_index``-th block of ``count`` prompts of the rotation from the iteration's first (:func:`rotating_subset`).
    Round 0's are the iteration's prompts as they were before rounds existed (wrapping around a file of fewer).

    >>> [i for i, _ in round_prompts("abcdefgh", count=2, iteration=1, round_index=1)]
    [4, 5]

    Raises:
        ValueError: a later round whose prompts and the earlier rounds' are more than ``prompts`` holds (one would
            come round again).
    """
    if round_index and (round_index + 1) * count > len(prompts):
        raise ValueError(
            f"round {round_index + 1} of {count} prompts needs {(round_index + 1) * count} prompts, the file holds "
            f"{len(prompts)}: a prompt would be sampled twice in one iteration"
        )
    return rotating_subset(prompts, count=count, iteration=iteration, offset=round_index * count)


def same_tokenizer(first: PreTrainedTokenizerBase, second: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers turn text into the same ids: the same vocabulary and special tokens."""
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    return first.get_vocab() == second.get_vocab() and all(getattr(first, s) == getattr(second, s) for s in specials)
