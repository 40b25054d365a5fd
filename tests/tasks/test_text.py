"""One rendering for every stage: prompts and conversations through each tokenizer's chat template (or the
plain format)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage.importers import render_chat
from tasks.text import (
    Prompt,
    conversation_id_lists,
    prompt_ids,
    response_id_lists,
    rotating_subset,
    round_prompts,
    same_tokenizer,
)
from tests.conftest import byte_level_bpe as bpe

CHAT = Prompt("\n\nHuman: tell me a joke\n\nAssistant:", ({"role": "user", "content": "tell me a joke"},))
PLAIN = Prompt("the cat is")


def test_a_chat_prompt_goes_through_the_template_with_its_generation_prompt():
    tokenizer = bpe()
    expected = tokenizer(
        "<|im_start|>user\ntell me a joke<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert prompt_ids(tokenizer, CHAT) == expected["input_ids"]


def test_without_a_template_a_chat_prompt_gets_the_plain_format_and_plain_text_stays_text():
    tokenizer = bpe(template=None)
    assert (
        prompt_ids(tokenizer, CHAT)
        == tokenizer(render_chat(list(CHAT.messages), add_generation_prompt=True))["input_ids"]
    )
    assert prompt_ids(bpe(), PLAIN) == bpe()("the cat is")["input_ids"]  # a template changes nothing for text


def test_a_conversation_puts_the_response_in_the_final_assistant_turn():
    tokenizer = bpe()
    ids = conversation_id_lists(tokenizer, [CHAT], ["why did the chicken"])[0]
    expected = "<|im_start|>user\ntell me a joke<|im_end|>\n<|im_start|>assistant\nwhy did the chicken<|im_end|>\n"
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    plain = conversation_id_lists(tokenizer, [PLAIN], ["happy ."])[0]  # prompt ids + " " + response + EOS
    assert plain == prompt_ids(tokenizer, PLAIN) + tokenizer(" happy .")["input_ids"] + [tokenizer.eos_token_id]


def test_conversations_tokenised_in_batches_are_those_tokenised_one_at_a_time():
    """A batch mixing chat and plain prompts, and an empty response, gives each row the ids its own
    tokenizer calls give, with and without a chat template (and so the same padding-free rows)."""
    prompts = [CHAT, PLAIN, CHAT, PLAIN]
    responses = ["why did the chicken", "happy .", "", ""]
    for tokenizer in (bpe(), bpe(template=None)):
        alone = []
        for prompt, response in zip(prompts, responses, strict=True):
            if prompt.messages and tokenizer.chat_template:
                turns = [*prompt.messages, {"role": "assistant", "content": response}]
                text = tokenizer.apply_chat_template(turns, tokenize=False)
                alone.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                said = tokenizer(" " + response, add_special_tokens=False)["input_ids"] if response else []
                alone.append(prompt_ids(tokenizer, prompt) + said + [tokenizer.eos_token_id])
        assert conversation_id_lists(tokenizer, prompts, responses) == alone
    assert conversation_id_lists(bpe(), [], []) == []


def test_issue45_a_pairs_response_is_the_conversation_after_the_prompts_ids_through_its_end_of_turn():
    """A DPO pair's response tokens: the reward model's rendering of the conversation in the policy's tokenizer, less
    the prompt the policy is given; a chat turn ends at its ``<|im_end|>``, not the template's newline after it."""
    tokenizer = bpe()
    prompts, responses = response_id_lists(tokenizer, [CHAT, PLAIN], ["why did the chicken", "happy ."])
    assert prompts == [prompt_ids(tokenizer, CHAT), prompt_ids(tokenizer, PLAIN)]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert responses[0] == tokenizer("why did the chicken", add_special_tokens=False)["input_ids"] + [end]
    assert responses[1] == tokenizer(" happy .")["input_ids"] + [tokenizer.eos_token_id]


def test_same_tokenizer_compares_vocabulary_and_special_tokens():
    assert same_tokenizer(bpe(), bpe())
    assert not same_tokenizer(bpe(), bpe(vocab_size=280))


def test_issue27_the_text_rules_and_a_generic_tokenizer_import_no_torch(tmp_path):
    """The input checks tokenise every prompt with this module before torch is imported (flows.inputs)."""
    bpe().save_pretrained(tmp_path)
    script = (
        "import sys\nfrom tasks.text import load_tokenizer, prompt_ids, Prompt\n"
        f"prompt_ids(load_tokenizer({str(tmp_path)!r}), Prompt('', ({{'role': 'user', 'content': 'hi'}},)))\n"
        "print('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert result.stdout.strip() == "False"


def _demo_model_folder(folder: Path, config) -> Path:
    """The demo's word-level tokenizer beside a model config, as the demo world saves its policy."""
    from demo.tokenizer import build_tokenizer

    build_tokenizer("the cat is happy . a dog sad tell me joke".split()).save_pretrained(folder)
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model", ["demo-gpt2", "demo-llama", "chatml-qwen2"])
def test_issue27_the_ids_the_checks_and_stages_encode_are_autotokenizers_and_its_chat_templates(model, tmp_path):
    """The input checks load a folder's tokenizer without torch (storage.tokenizers) and encode with the stages'
    own rule (prompt_ids); both give what AutoTokenizer and apply_chat_template give, for the tiny demo model and a
    chat model. SmolLM2's (a Llama converted from GGUF) is in tests/flows/test_smollm2.py (slow)."""
    from transformers import AutoTokenizer, GPT2Config, LlamaConfig

    from tasks.text import load_tokenizer
    from tests.conftest import tiny_config

    folder = tmp_path / model
    if model == "chatml-qwen2":
        bpe().save_pretrained(folder)
        tiny_config("qwen2", vocab_size=len(bpe())).save_pretrained(folder)
    else:
        _demo_model_folder(folder, GPT2Config(n_positions=64) if model == "demo-gpt2" else LlamaConfig())
    loaded, reference = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    turns = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a  joke ."})
    chat = Prompt(render_chat(list(turns), add_generation_prompt=True), turns)
    if reference.chat_template:
        expected = reference.apply_chat_template(list(turns), add_generation_prompt=True, return_dict=True)
    else:
        expected = reference(render_chat(list(turns), add_generation_prompt=True))
    assert prompt_ids(loaded, chat) == list(expected["input_ids"])
    assert prompt_ids(loaded, PLAIN) == reference(PLAIN.text)["input_ids"]


def test_issue43_each_round_of_an_iteration_takes_the_next_block_of_the_rotation():
    prompts = [f"prompt {i}" for i in range(10)]
    ids = [[i for i, _ in round_prompts(prompts, count=3, iteration=1, round_index=r)] for r in range(3)]
    # Iteration 1 starts at 1 x 3: its rounds take 3-5, 6-8, then 9, 0, 1 (wrapping, none of them used before).
    assert ids == [[3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert ids[0] == [i for i, _ in rotating_subset(prompts, count=3, iteration=1)]  # round 0: the iteration's own
    with pytest.raises(ValueError, match="round 4 of 3 prompts needs 12 prompts, the file holds 10"):
        round_prompts(prompts, count=3, iteration=1, round_index=3)  # 9 + 3 > 10: a prompt would come again
