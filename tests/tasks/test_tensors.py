"""Left padding, and reward scoring in the reward model's own tokens."""

from __future__ import annotations

import torch

from rlhf_core.models import RewardModel
from tasks.tensors import RewardScorer, encode_prompts
from tasks.text import Prompt, conversation_id_lists, prompt_ids
from tests.conftest import byte_level_bpe as bpe
from tests.conftest import tiny_config

CHAT = Prompt("\n\nHuman: tell me a joke\n\nAssistant:", ({"role": "user", "content": "tell me a joke"},))
PLAIN = Prompt("the cat is")


def test_prompts_are_left_padded():
    tokenizer = bpe()
    ids, mask = encode_prompts(tokenizer, [CHAT, PLAIN])
    lengths = [len(prompt_ids(tokenizer, prompt)) for prompt in (CHAT, PLAIN)]
    assert mask.sum(dim=1).tolist() == lengths and bool(mask[:, -1].all())
    assert ids[1, : ids.shape[1] - lengths[1]].eq(tokenizer.pad_token_id).all()


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
