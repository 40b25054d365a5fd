"""Tests for demo/pretrain.py: the loss equals Hugging Face's, the schedule's shape, and that training lowers the loss."""

from __future__ import annotations

import pytest
import torch

from demo.corpus import VOCABULARY, generate_corpus
from demo.pretrain import encode_corpus, learning_rate_factor, next_token_loss, pretrain
from demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer
from tests.conftest import tiny_causal_lm


def test_next_token_loss_equals_the_hugging_face_loss_with_masked_labels():
    model = tiny_causal_lm("gpt2")
    token_ids = torch.tensor([[BOS_ID, 5, 6, 7, EOS_ID, PAD_ID], [BOS_ID, 8, 9, EOS_ID, PAD_ID, PAD_ID]])
    attention_mask = (token_ids != PAD_ID).long()
    output = model(
        input_ids=token_ids, attention_mask=attention_mask, labels=token_ids.masked_fill(attention_mask == 0, -100)
    )
    torch.testing.assert_close(
        next_token_loss(output.logits, token_ids, attention_mask), output.loss, rtol=1e-6, atol=1e-6
    )


def test_encode_corpus_wraps_each_sentence_in_bos_and_eos():
    tokenizer = build_tokenizer(VOCABULARY)
    rows = encode_corpus(["the dog ran .", "she smiled happily ."], tokenizer)
    the, dog, ran, stop = tokenizer.convert_tokens_to_ids(["the", "dog", "ran", "."])
    assert rows[0].tolist() == [BOS_ID, the, dog, ran, stop, EOS_ID]
    assert rows[1, -1].item() == EOS_ID and rows.shape == (2, 6)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    factors = [learning_rate_factor(step, warmup_steps=10, total_steps=100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(later <= earlier for earlier, later in zip(factors[10:], factors[11:], strict=False))


def test_pretraining_lowers_the_loss_on_the_corpus():
    tokenizer = build_tokenizer(VOCABULARY)
    token_ids = encode_corpus(generate_corpus(200, seed=0), tokenizer)
    model = tiny_causal_lm("gpt2", vocab_size=len(tokenizer), hidden=32)
    attention_mask = (token_ids != PAD_ID).long()
    with torch.no_grad():
        before = next_token_loss(
            model(input_ids=token_ids, attention_mask=attention_mask).logits, token_ids, attention_mask
        )
    pretrain(
        model,
        token_ids,
        pad_token_id=PAD_ID,
        steps=30,
        batch_size=16,
        learning_rate=3e-3,
        warmup_steps=5,
        seed=0,
        progress=False,
    )
    with torch.no_grad():
        after = next_token_loss(
            model(input_ids=token_ids, attention_mask=attention_mask).logits, token_ids, attention_mask
        )
    assert after < 0.85 * before  # about 5.6 -> 4.6 in 30 steps
