"""One rendering for every stage: prompts and conversations through each tokenizer's chat template (or the
plain format), left padding, and reward scoring in the reward model's own tokens."""

from __future__ import annotations

import torch

from rlhf_core.models import RewardModel
from storage.importers import render_chat
from tasks.text import (
    Prompt,
    RewardScorer,
    conversation_id_lists,
    encode_prompts,
    prompt_ids,
    same_tokenizer,
)
from tests.conftest import byte_level_bpe as bpe
from tests.conftest import tiny_config

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


def test_prompts_are_left_padded():
    tokenizer = bpe()
    ids, mask = encode_prompts(tokenizer, [CHAT, PLAIN])
    lengths = [len(prompt_ids(tokenizer, prompt)) for prompt in (CHAT, PLAIN)]
    assert mask.sum(dim=1).tolist() == lengths and bool(mask[:, -1].all())
    assert ids[1, : ids.shape[1] - lengths[1]].eq(tokenizer.pad_token_id).all()


def test_same_tokenizer_compares_vocabulary_and_special_tokens():
    assert same_tokenizer(bpe(), bpe())
    assert not same_tokenizer(bpe(), bpe(vocab_size=280))


def test_a_reward_model_with_another_tokenizer_scores_the_re_rendered_conversation():
    policy, reward = bpe(), bpe(vocab_size=280)
    torch.manual_seed(0)
    model = RewardModel(config=tiny_config("llama", vocab_size=len(reward))).eval()
    scorer = RewardScorer(model, policy_tokenizer=policy, reward_tokenizer=reward, same_tokens=False)
    prompt = prompt_ids(policy, CHAT)
    response = policy("why did the chicken", add_special_tokens=False)["input_ids"] + [policy.eos_token_id]
    sequences = torch.tensor([prompt + response])
    attention = torch.ones_like(sequences)
    score = scorer.score([CHAT], sequences, attention, prompt_length=len(prompt))
    torch.testing.assert_close(score, scorer.score_texts([CHAT], ["why did the chicken"]), rtol=0, atol=0)
    ids = torch.tensor([conversation_id_lists(reward, [CHAT], ["why did the chicken"])[0]])
    with torch.no_grad():
        torch.testing.assert_close(score, model(ids, torch.ones_like(ids)), rtol=0, atol=0)


def test_a_reward_model_with_the_policys_tokenizer_scores_the_generated_ids_as_they_are():
    policy = bpe()
    torch.manual_seed(0)
    model = RewardModel(config=tiny_config("llama", vocab_size=len(policy))).eval()
    scorer = RewardScorer(model, policy_tokenizer=policy, reward_tokenizer=policy, same_tokens=True)
    sequences, attention = torch.tensor([[0, 5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(sequences, attention)
    torch.testing.assert_close(scorer.score([PLAIN], sequences, attention, prompt_length=3), expected, rtol=0, atol=0)


def test_a_chat_rollout_is_scored_as_the_reward_model_was_trained_with_the_policys_tokenizer_too():
    # Training renders a chat pair whole through the template (end-of-turn after the response included);
    # the generated ids end at EOS instead, so scoring them as they are would read another sequence.
    policy = bpe()
    torch.manual_seed(0)
    model = RewardModel(config=tiny_config("llama", vocab_size=len(policy))).eval()
    scorer = RewardScorer(model, policy_tokenizer=policy, reward_tokenizer=policy, same_tokens=True)
    prompt = prompt_ids(policy, CHAT)
    response = policy("why did the chicken", add_special_tokens=False)["input_ids"] + [policy.eos_token_id]
    sequences = torch.tensor([prompt + response])
    score = scorer.score([CHAT], sequences, torch.ones_like(sequences), prompt_length=len(prompt))
    ids = torch.tensor([conversation_id_lists(policy, [CHAT], ["why did the chicken"])[0]])
    with torch.no_grad():
        torch.testing.assert_close(score, model(ids, torch.ones_like(ids)), rtol=0, atol=0)
