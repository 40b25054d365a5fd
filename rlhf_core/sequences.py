"""Token bookkeeping: position ids, the action window, and the one logits/token off-by-one site.

Choices:
1. Logits at position ``i`` score token ``i + 1``. So response token ``t`` (column ``P + t``) is
   scored by the logits at column ``P + t - 1``; the critic's value for it comes from the hidden
   state at the same column (the state just before the action).
2. Position ids are ``cumsum(attention_mask) - 1`` (0 at padding), so left padding never shifts
   a token's position and padding cannot change any result.
3. Log-probs divide logits by the sampling temperature before the log-softmax.
"""

from __future__ import annotations

import inspect

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding does not shift them.

    Shapes:
        attention_mask: (B, T); returns (B, T) long.
    """
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def response_slice(per_position: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Select the outputs that belong to response tokens: columns ``P - 1 .. T - 2``.

    Output ``t`` is the model's output at the position just before response token ``t``.

    Shapes:
        per_position: (B, T, ...); returns (B, R, ...).
    """
    if prompt_length < 1:
        raise ValueError(f"`prompt_length` must be at least 1, got {prompt_length}")
    return per_position[:, prompt_length - 1 : -1]


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    Naive equivalent: ``torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None])[..., 0]``.
    Computed as ``z[token] - logsumexp(z)`` so the ``(B, R, V)`` log-softmax is never materialised.

    Shapes:
        logits: (B, R, V); tokens: (B, R); returns (B, R).
    """
    if temperature <= 0:
        raise ValueError(f"`temperature` must be positive, got {temperature}")
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature  # (B, R, V); no copy at 1
    token_logits = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, R)
    return token_logits - torch.logsumexp(scaled, dim=-1)


def response_logits(
    model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """The causal LM's logits that score the response tokens (columns ``P - 1 .. T - 2``).

    Same as ``response_slice(model(sequences, ...).logits, prompt_length)``, but the LM head runs
    only on those ``R`` positions when the model takes ``logits_to_keep`` (Hugging Face causal LMs
    do): the ``(B, T, V)`` logits of the prompt are never computed.

    Shapes:
        sequences, attention_mask: (B, T); returns (B, R, V).
    """
    if prompt_length < 1:
        raise ValueError(f"`prompt_length` must be at least 1, got {prompt_length}")
    keep = sequences.shape[1] - prompt_length + 1  # R + 1: columns P - 1 .. T - 1
    extra = {"logits_to_keep": keep} if _takes_logits_to_keep(model) else {}
    logits = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **extra,
    ).logits  # (B, R + 1, V) or (B, T, V)
    return logits[:, -keep:-1]  # (B, R, V)


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the causal LM under any wrappers (peft's, the adapters-off view, DDP's) takes ``logits_to_keep``."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            return True
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            model = getattr(model, "model", None) or getattr(model, "module", model)
    return False


def response_logprobs(
    logits: torch.Tensor, sequences: torch.Tensor, prompt_length: int, *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of the response tokens given full-sequence logits.

    Shapes:
        logits: (B, T, V); sequences: (B, T); returns (B, R).
    """
    response_logits = response_slice(logits, prompt_length)  # (B, R, V)
    response_tokens = sequences[:, prompt_length:]  # (B, R)
    return logprobs_from_logits(response_logits, response_tokens, temperature=temperature)


def action_mask_from_tokens(response_tokens: torch.Tensor, *, eos_token_id: int | None) -> torch.Tensor:
    """True for every response token up to and including the first EOS.

    Naive equivalent: per row, ``[True] * (index_of_first_eos + 1) + [False] * rest`` (all True
    when there is no EOS).

    Shapes:
        response_tokens: (B, R); returns (B, R) bool.
    """
    if eos_token_id is None:
        return torch.ones_like(response_tokens, dtype=torch.bool)
    is_eos = response_tokens == eos_token_id  # (B, R)
    eos_seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # (B, R)
    return ~eos_seen_before


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of the last real token in each row, for left or right padding.

    Shapes:
        attention_mask: (B, T); returns (B,) long.
    """
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # (T,)
    return (columns * attention_mask.long()).argmax(dim=1)
