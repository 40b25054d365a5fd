"""Token ids and loss mask of a supervised fine-tuning example: the loss falls on the assistant's tokens only.

An example is a conversation (chat turns) or a plain prompt and its completion
(:func:`storage.importers.import_sft_examples`). Each becomes the token ids of the whole example and a mask, True
exactly on the tokens the model learns to write.

Choices:
1. A conversation goes through the tokenizer's chat template, as every stage renders chat (:mod:`tasks.text`).
   Where the template marks the assistant's output with ``{% generation %}`` / ``{% endgeneration %}``, its own
   mask is used as it is (``apply_chat_template(..., return_assistant_tokens_mask=True)``): the template's author
   says which tokens are the assistant's. This is TRL's ``SFTTrainer`` with ``assistant_only_loss=True``, which
   needs such markers (it swaps in a training template of its own where they are missing).
2. Elsewhere, each message's delta: the ids of the conversation up to and including message ``k`` minus those up
   to message ``k - 1``. An assistant turn's delta starts after the template's generation prompt (the
   conversation before it rendered with ``add_generation_prompt=True``: ``<|im_start|>assistant\\n`` in ChatML),
   which the sampler is given and so never learns. Each shorter rendering must be a prefix of the longer one (the
   prefix property); a template that renders earlier turns differently once a later one follows (Qwen3's dropped
   reasoning, say) is refused in one line naming the message, since its tokens cannot be told apart.
3. What an assistant turn's mask holds (choice 2): its content and its end-of-turn token, the last token of the
   turn that is in the tokenizer's added vocabulary (``<|im_end|>``, SmolLM2's EOS), not the whitespace the template
   writes after it (ChatML's ``"\\n"``, a token of its own). Those are the tokens the policy samples for that turn,
   up to and including the token that stops it: the turn's ``action_mask`` in a rollout (R3), so SFT and the RL
   updates train on the same tokens. TRL checks the same boundary (``is_chat_template_stop_token_trained``:
   ignoring trailing whitespace, the last masked token must be an added token) but its ChatML training templates
   (``qwen2_5_training.jinja``) and its ``completion_only_loss`` also mask the ``"\\n"``, a token the model never
   samples since generation stops at the end-of-turn token; a template with markers (choice 1) keeps that choice.
   A turn with no added token at all is refused: the model would never learn to stop.
4. A prompt/completion pair: the prompt as the sampler tokenises a plain prompt (:func:`tasks.text.prompt_ids`:
   plain text with the tokenizer's own special tokens, no chat template), then the completion's ids and EOS, the
   mask on the completion and EOS. TRL appends EOS to a non-conversational completion too (``add_eos``), but
   tokenises prompt and completion as one text and only warns when the prompt's ids are no prefix of it; tokenised
   apart, the boundary is exact and the prompt's ids are those the sampler gives the model.
5. A conversation needs a chat template: the plain HH format of a tokenizer without one (:func:`storage.importers.render_chat`)
   has no end-of-turn token, so there would be nothing to stop on. Such a tokenizer takes prompt/completion rows.

References: TRL ``SFTTrainer._prepare_dataset`` (``tokenize_fn``, ``add_eos``) and
``chat_template_utils.is_chat_template_stop_token_trained`` at f2cd57710ae345ea6428ae95363267fcf38a3dc8.

Like :mod:`tasks.text`, this module imports no torch: the ids and masks are lists.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from rlhf_core.errors import UserError
from storage.schemas import COMPLETION, EXAMPLE_ID, MESSAGES, PROMPT
from tasks.text import Prompt, prompt_ids, turn_end

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""``{% generation %}`` and its whitespace-trimming forms (TRL ``has_generation_markers``)."""


class SftTokens(NamedTuple):
    """One example's token ids and loss mask, True on each token the model learns to write.

    Shapes:
        input_ids, loss_mask: (T,) as lists, T the example's length.
    """

    input_ids: list[int]
    loss_mask: list[bool]


class ChatTemplateError(UserError, ValueError):
    """A conversation the tokenizer's chat template cannot split into turns (or a tokenizer without a template)."""


def has_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template marks the assistant's output with ``{% generation %}``."""
    return bool(tokenizer.chat_template) and _GENERATION_MARKER.search(tokenizer.chat_template) is not None


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]) -> SftTokens:
    """The ids of a conversation through the tokenizer's chat template, masked on the assistant's turns.

    Naive equivalent without markers (choices 2 and 3; ``render`` = the template's ids of some turns, each
    rendering checked to extend the one before)::

        ids, mask = [], []
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                start = render(messages[:k], add_generation_prompt=True)
                ids, mask = start, mask + [False] * (len(start) - len(ids))
            whole = render(messages[: k + 1])
            turn = whole[len(ids):]
            end = last index in turn of an added token if the role is "assistant" else -1
            ids, mask = whole, mask + [i <= end for i in range(len(turn))]

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``{"role", "content"}`` turns, the first not the assistant's.

    Returns:
        The ids of the whole conversation as the template renders it, and their loss mask (module docstring).

    Shapes:
        returns (T,) lists.

    Raises:
        ChatTemplateError: no chat template; a template that breaks the prefix property or ends an assistant turn with
            no added token (the message names the turn); markers that mark none of the assistant's tokens.
    """
    messages = [dict(message) for message in messages]
    if not tokenizer.chat_template:
        raise ChatTemplateError(
            "the tokenizer has no chat template: a `messages` conversation needs one (give prompt/completion rows)"
        )
    if not messages or messages[0]["role"] == "assistant":
        raise ChatTemplateError("a conversation starts with a system or user turn, not an assistant turn")
    if has_generation_markers(tokenizer):
        return _marked(tokenizer, messages)
    ids: list[int] = []
    mask: list[bool] = []
    for k, message in enumerate(messages):
        name = f"messages[{k}] ({message['role']})"
        whole = _render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        _check_prefix(ids, whole, f"the chat template renders the turns before {name} differently once it follows")
        if message["role"] == "assistant":  # its header is the generation prompt: given, never learned
            start = _render(tokenizer, messages[:k], add_generation_prompt=True)
            problem = f"the chat template's generation prompt before {name} is not how it starts it"
            _check_prefix(ids, start, problem)
            _check_prefix(start, whole, problem)
            mask += [False] * (len(start) - len(ids))
            mask += _assistant_turn(tokenizer, whole[len(start) :], name)
        else:
            mask += [False] * (len(whole) - len(ids))
        ids = whole
    return SftTokens(ids, mask)


def turn_delta(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], *, ended: bool) -> list[int]:
    """The ids the chat template writes after the model's last sampled token of the conversation's last assistant turn,
    through the generation prompt of the next one: the rest of that turn (its end-of-turn token too when the model
    did not sample it, ``ended`` False), the messages after it (an environment's reply), and the next assistant
    header. What a multi-turn rollout appends to the model's own ids (:mod:`tasks.episodes`), never re-tokenizing them.

    The per-message delta of :func:`tokenize_conversation` (choices 2 and 3): the turn's mask ends at its end-of-turn
    token; what follows is the template's. For SmolLM2's ChatML, with an environment reply: ``"\n<|im_start|>user\n"
    ... "<|im_end|>\n<|im_start|>assistant\n"`` (the ``"\n"`` after ``<|im_end|>`` is the token verl #6501 drops).

    Args:
        messages: the conversation, an assistant turn (the model's text) and any messages after it last.
        ended: whether the model sampled the turn's end-of-turn token (else its turn was cut at its token budget).

    Raises:
        ChatTemplateError: as :func:`tokenize_conversation`, or no assistant turn.
    """
    messages = [dict(message) for message in messages]
    ids, mask = tokenize_conversation(tokenizer, messages)
    if not any(mask):
        raise ChatTemplateError("a turn delta follows an assistant turn: the conversation has none")
    end = max(index for index, bit in enumerate(mask) if bit)  # the last assistant turn's end-of-turn token
    following = _render(tokenizer, messages, add_generation_prompt=True)
    _check_prefix(ids, following, "the chat template's generation prompt is not how it continues the conversation")
    return following[end + 1 if ended else end :]


def rendering_drifts(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], ids: list[int]) -> bool:
    """Whether ``ids`` (a conversation's ids as sampled and appended, ending with its last assistant turn) are not a
    prefix of the chat template's rendering of the whole conversation's text: the drift a re-tokenizing trainer would
    train on (verl's ``tokenization_sanity_check_mode``)."""
    try:
        whole = tokenize_conversation(tokenizer, messages).input_ids
    except ChatTemplateError:
        return True
    return whole[: len(ids)] != ids


def tokenize_completion(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str) -> SftTokens:
    """The ids of a plain prompt, its completion and EOS, masked on the completion and EOS (choice 4).

    Args:
        tokenizer: any tokenizer with an EOS token; its chat template, if any, is not used.
        prompt: plain text, tokenised as :func:`tasks.text.prompt_ids` tokenises a plain prompt.
        completion: the text the model learns to write after it, tokenised as it is (its leading space included).

    Shapes:
        returns (T,) lists.

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token: a completion must end with one, or the model never stops")
    prompt_part = prompt_ids(tokenizer, Prompt(prompt))
    completion_part = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    if not completion_part or completion_part[-1] != tokenizer.eos_token_id:  # TRL's add_eos: once
        completion_part.append(tokenizer.eos_token_id)
    return SftTokens(prompt_part + completion_part, [False] * len(prompt_part) + [True] * len(completion_part))


def tokenize_examples(tokenizer: PreTrainedTokenizerBase, table: pa.Table) -> list[SftTokens]:
    """The ids and loss mask of each row of an ``SFT_EXAMPLES`` table: a conversation (:func:`tokenize_conversation`)
    or a prompt/completion pair (:func:`tokenize_completion`).

    Raises:
        ChatTemplateError: as :func:`tokenize_conversation`, the message beginning with the row's ``example_id``.
    """
    rows = zip(
        *(table.column(name).to_pylist() for name in (EXAMPLE_ID, MESSAGES, PROMPT, COMPLETION)),
        strict=True,
    )
    tokens = []
    for example_id, messages, prompt, completion in rows:
        if not messages:
            tokens.append(tokenize_completion(tokenizer, prompt, completion))
            continue
        try:
            tokens.append(tokenize_conversation(tokenizer, messages))
        except ChatTemplateError as error:
            raise ChatTemplateError(f"example {example_id}: {error}") from error
    return tokens


def nothing_to_learn(examples: Sequence[SftTokens]) -> int | None:
    """The index of the first example with no token to learn, or None: a mask True at the example's first token alone
    trains nothing (no logits score a sequence's first token)."""
    return next((index for index, example in enumerate(examples) if not any(example.loss_mask[1:])), None)


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, add_generation_prompt: bool
) -> list[int]:
    """The template's ids of ``messages`` (none for no message); the template writes any BOS itself."""
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_prefix(shorter: list[int], longer: list[int], problem: str) -> None:
    if longer[: len(shorter)] != shorter:
        raise ChatTemplateError(
            f"{problem} (the prefix property): its turns cannot be told apart; use a template that renders each turn "
            "alone, or one with {% generation %} markers"
        )


def _assistant_turn(tokenizer: PreTrainedTokenizerBase, turn: list[int], name: str) -> list[bool]:
    """The mask of an assistant turn's delta: through its end of turn (:func:`tasks.text.turn_end`; choice 3)."""
    if (end := turn_end(tokenizer, turn)) is None:
        raise ChatTemplateError(
            f"the chat template ends {name} with no special token: the model would never learn to stop"
        )
    return [index < end for index in range(len(turn))]


def _marked(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> SftTokens:
    """The template's own assistant mask (choice 1)."""
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    mask = [bool(bit) for bit in encoded["assistant_masks"]]
    if any(message["role"] == "assistant" for message in messages) and not any(mask):
        raise ChatTemplateError("the chat template's {% generation %} markers mark none of the assistant's tokens")
    return SftTokens(list(encoded["input_ids"]), mask)
