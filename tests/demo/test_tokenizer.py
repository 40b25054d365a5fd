"""Tests for demo/tokenizer.py: special ids, round trip through save_pretrained / AutoTokenizer, decoding."""

from __future__ import annotations

from transformers import AutoTokenizer

from demo.corpus import VOCABULARY
from demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, build_tokenizer


def test_special_ids_and_vocabulary_size():
    tokenizer = build_tokenizer(VOCABULARY)
    assert (
        (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
        == (
            PAD_ID,
            BOS_ID,
            EOS_ID,
            UNK_ID,
        )
        == (0, 1, 2, 3)
    )
    assert len(tokenizer) == 4 + len(VOCABULARY)


def test_round_trip_through_auto_tokenizer(tmp_path):
    build_tokenizer(VOCABULARY).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["the old dog found a bright red ball near the river .", "she smiled"]
    batch = tokenizer(texts, padding=True)
    long_row, short_row = batch["input_ids"]
    assert long_row[0] == BOS_ID and EOS_ID not in long_row  # <bos> added, <eos> left to the model
    assert short_row[: len(long_row) - 3] == [PAD_ID] * (len(long_row) - 3)  # left padding
    assert batch["attention_mask"][1][-3:] == [1, 1, 1]
    assert tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True) == texts
    assert tokenizer.decode([BOS_ID, *long_row[1:], EOS_ID, PAD_ID], skip_special_tokens=True) == texts[0]


def test_punctuation_is_split_and_unknown_words_map_to_unk():
    tokenizer = build_tokenizer(VOCABULARY)
    assert tokenizer.tokenize("the dog.") == ["the", "dog", "."]
    assert tokenizer("the zebra")["input_ids"] == [BOS_ID, tokenizer.convert_tokens_to_ids("the"), UNK_ID]
