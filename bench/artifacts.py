"""The shared inputs of the TRL comparison, written once per size into a folder both venvs read.

Layout (every file an ordinary Hugging Face or JSON file)::

    <dir>/size.json        the Size (shapes, batch, response length, epochs, temperature, ...)
    <dir>/tokenizer/       the demo world's word-level tokenizer (left padding, pad 0, eos 2)
    <dir>/policy/          GPT2LMHeadModel: actor, and (loaded a second time) the frozen reference
    <dir>/value/           GPT2ForSequenceClassification, num_labels=1: TRL's value model, our critic
    <dir>/reward/          GPT2ForSequenceClassification, num_labels=1: TRL's reward model, ours
    <dir>/prompts.jsonl    {"input_ids": [...]} per line: demo prompts, tokenised once

Choices:
1. Models are random-initialised from a config in code (nothing comes from a hub) with dropout off,
   each from its own seed. Throughput does not depend on what the weights have learnt.
2. The model vocabulary is padded past the tokenizer's 259 words to 2,048 / 4,096 rows so the LM
   head costs what a BPE vocabulary of the peer benchmark's size costs; sampled ids above 258 are
   never decoded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

from bench.common import Size, size_to_json
from demo.corpus import VOCABULARY, generate_prompts
from demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer


def gpt2_config(size: Size, **extra) -> GPT2Config:
    return GPT2Config(
        vocab_size=size.vocab_size,
        n_positions=size.n_positions,
        n_embd=size.n_embd,
        n_layer=size.n_layer,
        n_head=size.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **extra,
    )


def build_artifacts(size: Size, directory: Path) -> Path:
    """Write (or reuse) the folder of shared inputs for ``size``; returns it."""
    directory = Path(directory)
    if (directory / "size.json").is_file() and json.loads((directory / "size.json").read_text()) == size.__dict__:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(VOCABULARY, model_max_length=size.n_positions)
    tokenizer.save_pretrained(directory / "tokenizer")
    for name, seed in (("policy", size.seed), ("value", size.seed + 1), ("reward", size.seed + 2)):
        torch.manual_seed(seed)
        if name == "policy":
            model = GPT2LMHeadModel(gpt2_config(size))
        else:
            model = GPT2ForSequenceClassification(gpt2_config(size, num_labels=1))
        model.save_pretrained(directory / name)
    needed = size.rollout_batch * size.iterations
    prompts, _ = generate_prompts(needed, 1, seed=size.seed)
    with (directory / "prompts.jsonl").open("w") as out:
        for text in prompts:
            out.write(json.dumps({"input_ids": tokenizer(text)["input_ids"]}) + "\n")
    size_to_json(size, directory / "size.json")
    return directory


def read_prompts(directory: Path) -> list[list[int]]:
    with (Path(directory) / "prompts.jsonl").open() as lines:
        return [json.loads(line)["input_ids"] for line in lines if line.strip()]


def prompt_columns(directory: Path, size: Size) -> float:
    """The left-padded prompt width P, averaged over a run's iterations (both sides take the same rows)."""
    prompts = read_prompts(directory)
    batch = size.rollout_batch
    widths = [
        max(len(prompts[(iteration * batch + row) % len(prompts)]) for row in range(batch))
        for iteration in range(size.iterations)
    ]
    return sum(widths) / len(widths)
