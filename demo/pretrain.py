"""Teach a tiny causal LM the demo corpus: next-token prediction on ``<bos> sentence <eos>``.

Choices:
1. Every sentence becomes one right-padded row ``<bos> w1 .. wn <eos> <pad> ..``; padding carries no
   loss, so the model learns to end each sentence with ``.`` and then ``<eos>``.
2. Batches are drawn with replacement by a seeded ``torch.Generator`` and the weights are
   initialised under a forked, seeded global RNG, so the result depends on the seed only (on one
   thread; the caller fixes the thread count) and the caller's random state is left alone.
3. AdamW with linear warm-up and cosine decay to a tenth of the peak rate: the nanoGPT schedule,
   which reaches a low loss in a few hundred steps at this size.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def encode_corpus(sentences: list[str], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Token ids of ``<bos> sentence <eos>``, right-padded with the pad id.

    Args:
        sentences: corpus text; the tokenizer must add ``<bos>`` itself.
        tokenizer: the world's tokenizer.

    Returns:
        Long tensor of token ids.

    Shapes:
        returns (B, T) with B = len(sentences) and T the longest row.
    """
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(sentences)["input_ids"]]
    width = max(len(row) for row in rows)
    return torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])  # (B, T)


def next_token_loss(logits: torch.Tensor, token_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each real token given the ones before it (logits at ``i`` score token ``i + 1``).

    Naive equivalent: ``model(input_ids, attention_mask, labels=token_ids.masked_fill(mask == 0, -100)).loss``,
    computed here so that no model-specific loss lookup (and its warning) is involved.

    Shapes:
        logits: (B, T, V); token_ids, attention_mask: (B, T); returns a scalar.
    """
    targets = token_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)  # (B, T - 1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def learning_rate_factor(step: int, *, warmup_steps: int, total_steps: int, min_factor: float = 0.1) -> float:
    """Multiplier of the peak learning rate: linear warm-up, then cosine decay to ``min_factor``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def pretrain(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    *,
    pad_token_id: int,
    steps: int,
    batch_size: int,
    learning_rate: float,
    warmup_steps: int,
    seed: int,
    progress: bool = True,
) -> float:
    """Train ``model`` in place on random batches of ``token_ids``.

    Args:
        model: a causal LM (``AutoModelForCausalLM``).
        token_ids: right-padded training rows from :func:`encode_corpus`.
        pad_token_id: the padding id (its positions get no loss and no attention).
        steps: optimizer steps.
        batch_size: rows per step.
        learning_rate: peak AdamW learning rate.
        warmup_steps: steps of linear warm-up.
        seed: seed of the batch sampler.
        progress: show a tqdm bar.

    Returns:
        The mean training loss over the last tenth of the steps.

    Shapes:
        token_ids: (N, T).
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(step, warmup_steps=warmup_steps, total_steps=steps)
    )
    model.train()
    tail_losses = []
    bar = tqdm(range(steps), desc="pretraining the demo LM", disable=not progress, leave=False)
    for step in bar:
        rows = torch.randint(token_ids.shape[0], (batch_size,), generator=generator)  # (B,)
        batch = token_ids[rows]  # (B, T)
        attention_mask = (batch != pad_token_id).long()  # (B, T)
        logits = model(input_ids=batch, attention_mask=attention_mask).logits  # (B, T, V)
        loss = next_token_loss(logits, batch, attention_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step >= steps - max(1, steps // 10):
            tail_losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return sum(tail_losses) / len(tail_losses) if tail_losses else float("nan")
