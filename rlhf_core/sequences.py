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
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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


_CHUNK_ROWS = 16
"""Rows of (N, V) logits processed together: 16 x V floats stay in a core's cache across the handful of
passes a row needs, instead of each pass streaming the whole (N, V) tensor through memory."""


class TokenLogprobs(NamedTuple):
    """Log-probs of the given tokens and the entropy of each distribution.

    Shapes:
        logprobs: (...) float32, differentiable; entropy: (...) float32, detached.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor


class _FusedTokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits / T)[token]`` and the entropy, chunk by chunk; backward without saving the softmax.

    Forward keeps only ``logsumexp(z)`` per row (``z = logits / T``). Backward recomputes the softmax
    chunk by chunk: ``d logp / d logits = (onehot(token) - softmax(z)) / T``.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float):  # type: ignore[override]
        rows = logits.shape[0]
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (N,)
        entropy = torch.empty_like(logprobs)  # (N,)
        normalizers = torch.empty_like(logprobs)  # (N,)
        for start in range(0, rows, _CHUNK_ROWS):
            chunk = slice(start, start + _CHUNK_ROWS)
            z = logits[chunk].float() / temperature  # (c, V)
            normalizer = torch.logsumexp(z, dim=-1)  # (c,)
            logprobs[chunk] = z.gather(1, tokens[chunk].unsqueeze(1)).squeeze(1) - normalizer
            probabilities = torch.exp(z - normalizer.unsqueeze(1))  # (c, V)
            # H = logsumexp(z) - sum(p * z); a token filtered to z = -inf has p = 0 and adds nothing.
            finite = torch.where(probabilities > 0, z, 0.0)  # (c, V)
            entropy[chunk] = normalizer - (probabilities * finite).sum(dim=-1)
            normalizers[chunk] = normalizer
        ctx.save_for_backward(logits, tokens, normalizers)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, _grad_entropy: torch.Tensor):  # type: ignore[override]
        logits, tokens, normalizers = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)  # (N, V)
        for start in range(0, logits.shape[0], _CHUNK_ROWS):
            chunk = slice(start, start + _CHUNK_ROWS)
            scale = grad_logprobs[chunk].float().unsqueeze(1) / temperature  # (c, 1)
            z = logits[chunk].float() / temperature  # (c, V)
            grad = torch.exp(z - normalizers[chunk].unsqueeze(1)).mul_(-scale)  # (c, V): -softmax * g / T
            grad.scatter_add_(1, tokens[chunk].unsqueeze(1), scale)  # + onehot * g / T
            grad_logits[chunk] = grad
        return grad_logits, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> TokenLogprobs:
    """Log-probability of each token under ``softmax(logits / temperature)``, and that distribution's entropy.

    Naive equivalent::

        z = logits.float() / temperature
        logprobs = torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]
        entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)   # 0 * log 0 = 0

    Fused and chunked (:class:`_FusedTokenLogprobs`): neither the scaled logits nor the softmax is
    materialised at full size, in the forward or the backward pass. Only ``logprobs`` has a gradient;
    the entropy is a statistic (an entropy bonus needs :func:`rlhf_core.losses.entropy_from_logits`).

    Shapes:
        logits: (..., V); tokens: (...); returns two (...) float32 tensors.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature` must be positive, got {temperature}")
    shape = tokens.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V); a view when ``logits`` is contiguous
    logprobs, entropy = _FusedTokenLogprobs.apply(flat_logits, tokens.reshape(-1), float(temperature))
    return TokenLogprobs(logprobs.reshape(shape), entropy.reshape(shape))


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    Naive equivalent: ``torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None])[..., 0]``.
    See :func:`token_logprobs` (this is its ``logprobs``).

    Shapes:
        logits: (B, R, V); tokens: (B, R); returns (B, R).
    """
    return token_logprobs(logits, tokens, temperature=temperature).logprobs


def response_logits(
    model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """The causal LM's logits that score the response tokens (columns ``P - 1 .. T - 2``).

    Same as ``response_slice(model(sequences, ...).logits, prompt_length)``, but the LM head runs
    only on those ``R`` positions when the model takes ``logits_to_keep`` (Hugging Face causal LMs
    do, as positions to keep): the ``(B, T, V)`` logits of the prompt are never computed, and the
    result is contiguous, so nothing downstream copies it.

    Shapes:
        sequences, attention_mask: (B, T); returns (B, R, V).
    """
    if prompt_length < 1:
        raise ValueError(f"`prompt_length` must be at least 1, got {prompt_length}")
    if not _takes_logits_to_keep(model):
        logits = model(
            input_ids=sequences,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).logits  # (B, T, V)
        return response_slice(logits, prompt_length)  # (B, R, V)
    columns = torch.arange(prompt_length - 1, sequences.shape[1] - 1, device=sequences.device)  # (R,)
    return model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=columns,
    ).logits  # (B, R, V)


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


@torch.no_grad()
def sequence_logprobs(
    model: PreTrainedModel,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of the response tokens under ``model`` (one forward pass), in fp32.

    Shapes:
        sequences, attention_mask: (B, T); returns (B, R).
    """
    logits = response_logits(model, sequences, attention_mask, prompt_length)  # (B, R, V)
    return logprobs_from_logits(logits, sequences[:, prompt_length:], temperature=temperature)
