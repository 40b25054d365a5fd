"""Issue 45: the SFT loss falls on the assistant's tokens only, its content and end-of-turn token, through the chat
template's own mask or each message's delta; a prompt/completion pair on its completion and EOS. The real SmolLM2
ids are pinned in tests/flows/test_smollm2.py (its tokenizer takes seconds to read)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage.importers import import_sft_examples
from tasks.sft_text import (
    ChatTemplateError,
    SftTokens,
    has_generation_markers,
    nothing_to_learn,
    rendering_drifts,
    tokenize_completion,
    tokenize_conversation,
    tokenize_examples,
    turn_delta,
)
from tasks.text import Prompt, prompt_ids
from tests.conftest import byte_level_bpe as bpe

JOKE = [{"role": "user", "content": "tell me a joke"}, {"role": "assistant", "content": "why did the chicken"}]
LONGER = [
    {"role": "system", "content": "a dog is sad ."},
    *JOKE,
    {"role": "user", "content": "the cat is happy ."},
    {"role": "assistant", "content": "cross the road"},
]
MARKED = (  # tests/conftest.py's CHATML with {% generation %} around the assistant's content and <|im_end|>
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _masked(tokenizer, tokens: SftTokens) -> list[str]:
    return [tokenizer.convert_ids_to_tokens(i) for i, bit in zip(*tokens, strict=True) if bit]


def test_the_mask_covers_the_assistants_content_and_end_of_turn_token_only():
    """conftest's byte-level BPE (ids 0-2 its specials <pad>, <|im_start|>, <|im_end|>; 201 is Ċ, the newline),
    ChatML template, token by token:

        <|im_start|> u s e r Ċ  tell Ġme Ġa Ġjo ke  <|im_end|> Ċ     all given: 0
        <|im_start|> a ss is t a n t Ċ                             the generation prompt: 0
        why Ġdid Ġthe Ġchi cken <|im_end|>                          the assistant's turn: 1
        Ċ                                                           the template's newline after it: 0
    """
    tokenizer = bpe()
    tokens = tokenize_conversation(tokenizer, JOKE)
    user = [1, 87, 85, 71, 84, 201, 298, 290, 286, 289, 264, 2, 201]
    header = [1, 67, 282, 263, 86, 67, 80, 86, 201]
    answer = [285, 295, 268, 294, 297, 2]
    assert tokens.input_ids == user + header + answer + [201]
    assert tokens.loss_mask == [False] * (len(user) + len(header)) + [True] * len(answer) + [False]
    assert _masked(tokenizer, tokens) == ["why", "Ġdid", "Ġthe", "Ġchi", "cken", "<|im_end|>"]
    full = tokenizer(tokenizer.apply_chat_template(JOKE, tokenize=False), add_special_tokens=False)["input_ids"]
    assert tokens.input_ids == full  # the ids are the template's rendering of the whole conversation


def test_every_assistant_turn_is_masked_and_nothing_else():
    tokenizer = bpe()
    tokens = tokenize_conversation(tokenizer, LONGER)
    assert _masked(tokenizer, tokens) == [
        *["why", "Ġdid", "Ġthe", "Ġchi", "cken", "<|im_end|>"],
        *["c", "ro", "ss", "Ġthe", "Ġroad", "<|im_end|>"],
    ]
    # and each run of masked tokens starts right after a generation prompt
    prompt = prompt_ids(tokenizer, Prompt("", tuple(LONGER[:2])))
    assert tokens.input_ids[: len(prompt)] == prompt and not any(tokens.loss_mask[: len(prompt)])
    assert tokens.loss_mask[len(prompt)]


def test_a_template_with_generation_markers_gives_its_own_mask_here_the_same():
    """The template's own mask (transformers' ``return_assistant_tokens_mask``) where it has markers; marking the
    content and <|im_end|>, it agrees with the delta of each message."""
    marked = bpe(template=MARKED)
    assert has_generation_markers(marked) and not has_generation_markers(bpe())
    for conversation in (JOKE, LONGER):
        assert tokenize_conversation(marked, conversation) == tokenize_conversation(bpe(), conversation)
    wider = bpe(template=MARKED.replace("'<|im_end|>' }}{% endgeneration %}", "'<|im_end|>\n' }}{% endgeneration %}"))
    assert _masked(wider, tokenize_conversation(wider, JOKE))[-2:] == ["<|im_end|>", "Ċ"]  # its choice, kept


def test_a_prompt_and_completion_mask_the_completion_and_eos():
    """Prompt ids as the sampler's (plain text: no chat template even where there is one), completion ids, EOS."""
    for tokenizer in (bpe(template=None), bpe()):
        tokens = tokenize_completion(tokenizer, "the cat is", " happy .")
        # the cat is | Ġhappy Ġ. <|im_end|>
        assert tokens == SftTokens([260, 293, 269, 288, 281, 266, 2], [False] * 3 + [True] * 4)
        assert _masked(tokenizer, tokens) == ["Ġhap", "py", "Ġ.", "<|im_end|>"]
    assert tokenize_completion(bpe(), "the cat is", " happy .<|im_end|>") == tokens  # EOS once


def test_a_table_of_examples_is_tokenised_row_by_row(tmp_path: Path):
    path = tmp_path / "sft.jsonl"
    rows = [{"messages": JOKE}, {"prompt": "the cat is", "completion": " happy ."}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = bpe()
    assert tokenize_examples(tokenizer, import_sft_examples(path)) == [
        tokenize_conversation(tokenizer, JOKE),
        tokenize_completion(tokenizer, "the cat is", " happy ."),
    ]


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (  # earlier turns rendered differently once another follows (the last turn alone is upper-cased)
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
            "{{ (m['content'] | upper if loop.last else m['content']) + '<|im_end|>\n' }}{% endfor %}",
            r"^the chat template renders the turns before messages\[1\] \(assistant\) differently once it follows",
        ),
        (  # a generation prompt that is not how the template starts an assistant turn
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>' }}{% endif %}",
            r"^the chat template's generation prompt before messages\[1\] \(assistant\) is not how it starts it",
        ),
        (  # no end-of-turn token
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
            r"^the chat template ends messages\[1\] \(assistant\) with no special token",
        ),
        ("{% for m in messages %}{% generation %}{% endgeneration %}{{ m['content'] }}{% endfor %}", "mark none"),
        (None, "no chat template"),
    ],
)
def test_a_conversation_the_template_cannot_split_is_refused_in_one_line(template, problem):
    with pytest.raises(ChatTemplateError, match=problem) as caught:
        tokenize_conversation(bpe(template=template), JOKE)
    assert "\n" not in str(caught.value)


def test_a_refusal_in_a_table_names_the_example(tmp_path: Path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"messages": JOKE}) + "\n")
    with pytest.raises(ChatTemplateError, match=r"^example 1: the tokenizer has no chat template"):
        tokenize_examples(bpe(template=None), import_sft_examples(path))
    with pytest.raises(ChatTemplateError, match="starts with a system or user turn"):
        tokenize_conversation(bpe(), JOKE[1:])


GUESS = [
    {"role": "user", "content": "tell me a joke"},
    {"role": "assistant", "content": "why did the chicken"},
    {"role": "user", "content": "the cat is happy ."},
]


def test_issue44_an_environment_reply_appends_the_template_delta_after_the_models_end_of_turn():
    """Token in, token out: what follows the model's sampled `<|im_end|>` is the `\\n` the template writes after it
    (the token verl #6501 drops), the reply's turn, and the next assistant header; a turn cut at its budget is closed
    with the template's `<|im_end|>` first."""
    tokenizer = bpe()
    delta = turn_delta(tokenizer, GUESS, ended=True)
    tokens = tokenizer.convert_ids_to_tokens(delta)
    assert tokens[:2] == ["Ċ", "<|im_start|>"] and tokens[-1] == "Ċ"  # the newline after `<|im_end|>`: its own token
    assert tokenizer.decode(delta) == "\n<|im_start|>user\nthe cat is happy .<|im_end|>\n<|im_start|>assistant\n"
    cut = turn_delta(tokenizer, GUESS, ended=False)
    assert cut == [tokenizer.convert_tokens_to_ids("<|im_end|>"), *delta]
    # The model's ids, then the deltas: the whole conversation's rendering, turn by turn, with no re-tokenization.
    model = tokenizer("why did the chicken", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt_ids(tokenizer, Prompt("", (GUESS[0],))) + model + delta
    follow_up = [*GUESS, {"role": "assistant", "content": "cross the road"}]
    assert ids == tokenize_conversation(tokenizer, follow_up).input_ids[: len(ids)]
    assert not rendering_drifts(tokenizer, GUESS[:2], ids[: -len(delta)])
    odd = ids[: -len(delta)]  # the same text, other ids: as a trainer that re-tokenizes would see a drift
    odd[-3:-1] = tokenizer("chick", add_special_tokens=False)["input_ids"][:1] * 2
    assert rendering_drifts(tokenizer, GUESS[:2], odd)
    # No message from the environment: the model answers again after the template's delta alone.
    assert tokenizer.decode(turn_delta(tokenizer, GUESS[:2], ended=True)) == "\n<|im_start|>assistant\n"


def test_an_example_whose_only_learned_token_is_its_first_has_nothing_to_learn():
    """No logits score a sequence's first token, so a mask True there alone trains nothing."""
    learns = SftTokens([4, 5], [False, True])
    assert nothing_to_learn([learns, learns]) is None
    assert nothing_to_learn([learns, SftTokens([4, 5], [True, False]), SftTokens([6], [False])]) == 1
