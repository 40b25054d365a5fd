"""Batched, KV-cached sampling from any Hugging Face causal LM, with explicit seeds.

Choices:
1. A plain decode loop over the model's own KV cache instead of ``model.generate``: it gives
   exact control of positions (from the attention mask, so left padding changes nothing), of the
   random stream (one ``torch.Generator``), and returns the log-probs of the sampled tokens.
2. Log-probs are taken from ``log_softmax(logits / temperature)`` before any top-k / top-p
   filtering, which is what the training-time forward computes (TRL, OpenRLHF do the same).
3. After a row emits EOS it is padded (attention 0, action mask False); the loop stops when
   every row has finished, so ``R <= max_new_tokens``.
4. Tokens are drawn by inverse CDF from one uniform number per row and step, and those numbers
   come from a CPU ``torch.Generator``: B numbers a step cross to the device, and the same seed
   samples the same tokens on any device (up to float rounding of the cumulative sums).
5. The engine behind :func:`generate` is chosen by what it is given: a model samples here (``hf``), an
   :class:`ExternalSampler` (the long-lived vLLM engine serving a policy, :class:`runtime.engine_client.ServedPolicy`)
   samples elsewhere, one request per row with the row's own seed (so a row's tokens do not depend on the rows beside it). Either way the result
   has the same layout, and ``logprobs`` are the sampler's own (vLLM's processed log-probs: after
   temperature, and, unlike ours, after top-k / top-p filtering where those are set).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Protocol

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from rlhf_core.config import SamplingConfig
from rlhf_core.divergence import check_finite
from rlhf_core.models import evaluating, fused_activations
from rlhf_core.sequences import position_ids_from_mask


class ExternalSampler(Protocol):
    """A policy sampled outside this process (choice 5): one response per prompt, each with its own seed."""

    def sample(
        self, prompts: list[list[int]], seeds: list[int], *, config: SamplingConfig, eos_token_id: int | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's response tokens (EOS included when reached) and the sampler's log-prob of each."""
        ...


class Generation(NamedTuple):
    """Sampled responses.

    Shapes:
        sequences: (B, T) long; attention_mask: (B, T) long; action_mask: (B, R) bool;
        logprobs: (B, R) float (0 outside the action mask).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    logprobs: torch.Tensor


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf.

    The most likely token is always kept.

    Shapes:
        logits: (B, V); returns (B, V).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        sorted_probabilities = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities  # (B, V)
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row by inverse CDF: the first token whose cumulative probability exceeds ``u``.

    Naive equivalent, per row: ``c = 0; for v in range(V): c += p[v]; if c > u * sum(p): return v``.
    With ``u ~ U[0, 1)`` each token is drawn with probability ``p[v] / sum(p)`` (what
    ``torch.multinomial(p, 1)`` draws), and a token of probability 0 is never drawn.

    Args:
        probabilities: non-negative, each row with a positive sum (need not be normalised).
        uniforms: one number in [0, 1) per row, on any device.

    Shapes:
        probabilities: (B, V); uniforms: (B,); returns (B,) long.
    """
    cdf = probabilities.float().cumsum(dim=-1)  # (B, V)
    threshold = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]  # (B, 1)
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(1)  # (B,)
    # Rounding can lift the threshold to the total (the cdf is flat from the last token of positive probability
    # on); that token is the answer then. Rare, so the (B, V) passes that find it run only when it happens.
    overflow = threshold.squeeze(1) >= cdf[:, -1]  # (B,)
    if bool(overflow.any()):
        vocabulary = probabilities.shape[-1]
        last_possible = vocabulary - 1 - (probabilities > 0).flip(-1).int().argmax(dim=-1)  # (B,)
        token = torch.where(overflow, last_possible, token)
    return token


class _PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers allocated once for ``length`` positions.

    Each step writes its position in place and hands attention a view of the filled part: the same
    tensors a ``DynamicLayer`` returns, which instead concatenates (copies) the whole cache at every
    step: a copy that grows with every step, so its cost grows with the square of the response length.
    """

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self.key_buffer = key_states.new_empty(batch, heads, self.length, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(batch, value_states.shape[1], self.length, value_states.shape[-1])
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def _kv_cache(model: PreTrainedModel, length: int) -> Cache:
    """The model's own KV cache, with preallocated layers (:class:`_PreallocatedLayer`) where it would use
    plain dynamic ones (a sliding-window or other special layer is kept as the model asks)."""
    cache = DynamicCache(config=model.config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        return Cache(layers=[_PreallocatedLayer(length) for _ in cache.layers])
    return cache


def _cache_keyword(model: PreTrainedModel) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` since transformers 5.x renamed it (the old
    ``past_key_values`` still works there, with a deprecation warning per call site), ``past_key_values`` before
    and in models that define their own forward. A PEFT model passes it through to the model it wraps."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _decode(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    config: SamplingConfig,
    eos_token_id: int | None,
    pad_token_id: int,
    generator: torch.Generator | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The KV-cached decode loop: per step, the sampled token, whether it is an action, its log-prob."""
    batch, prompt_length = prompt_ids.shape
    device = prompt_ids.device
    # The whole mask is allocated once and grows by a column per step: a view, never a copy.
    full_mask = torch.zeros(batch, prompt_length + config.max_new_tokens, dtype=torch.long, device=device)
    full_mask[:, :prompt_length] = prompt_mask
    attention_mask = full_mask[:, :prompt_length]  # (B, P)
    positions = position_ids_from_mask(attention_mask)  # (B, P)
    # The model writes every step's keys and values into this one cache object, in place.
    cache = {_cache_keyword(model): _kv_cache(model, prompt_length + config.max_new_tokens)}
    outputs = model(
        input_ids=prompt_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, **cache
    )
    next_position = positions[:, -1:] + 1  # (B, 1)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, logprobs, alive = [], [], []
    for _ in range(config.max_new_tokens):
        scaled = outputs.logits[:, -1, :].float() / config.temperature  # (B, V)
        check_finite(scaled, model="actor", quantity="logits")  # else sampling draws from NaN probabilities
        token_logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
        probabilities = torch.softmax(filter_logits(scaled, top_k=config.top_k, top_p=config.top_p), dim=-1)
        token = sample_tokens(probabilities, torch.rand(batch, generator=generator))  # (B,)
        token = token.masked_fill(finished, pad_token_id)
        is_action = ~finished  # (B,)
        tokens.append(token)
        alive.append(is_action)
        logprobs.append(token_logprobs.gather(1, token.unsqueeze(1)).squeeze(1) * is_action)
        if eos_token_id is not None:
            finished = finished | (token == eos_token_id)
        if bool(finished.all()):
            break
        columns = attention_mask.shape[1]
        full_mask[:, columns] = is_action
        attention_mask = full_mask[:, : columns + 1]  # (B, P + t + 1)
        outputs = model(
            input_ids=token.unsqueeze(1),
            attention_mask=attention_mask,
            position_ids=next_position,
            use_cache=True,
            **cache,
        )
        next_position = next_position + 1
    return tokens, alive, logprobs


@torch.no_grad()
def generate(
    model: PreTrainedModel | ExternalSampler,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    config: SamplingConfig,
    eos_token_id: int | None,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    seeds: list[int] | None = None,
) -> Generation:
    """Sample one response per row.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), or an :class:`ExternalSampler` (the vLLM engine).
        prompt_ids: left-padded prompts.
        prompt_mask: 1 for real prompt tokens.
        config: temperature, top-k, top-p and ``max_new_tokens``.
        eos_token_id: token that ends a response, or None.
        pad_token_id: token written after EOS.
        generator: CPU random stream for sampling here (a model); pass a seeded one for reproducible samples.
        seeds: one seed per row, for an :class:`ExternalSampler` (required there, unused here).

    Shapes:
        prompt_ids, prompt_mask: (B, P); seeds: B numbers; returns :class:`Generation` with T = P + R.

    Raises:
        Whatever an :class:`ExternalSampler` raises (the engine is gone or failed the request).
    """
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
        raise ValueError(
            f"`prompt_ids` {tuple(prompt_ids.shape)} and `prompt_mask` {tuple(prompt_mask.shape)} must be equal 2-D shapes"
        )
    if bool((prompt_mask.sum(dim=1) == 0).any()):
        raise ValueError("every prompt needs at least one real token")
    if not bool(prompt_mask[:, -1].bool().all()):
        # A right-padded row would be continued from the logits of a padding position.
        raise ValueError("`prompt_ids` must be left-padded: the last column of `prompt_mask` must be 1 in every row")
    if not isinstance(model, torch.nn.Module):
        if seeds is None or len(seeds) != prompt_ids.shape[0]:
            raise ValueError("generating with the engine needs `seeds`: one per row of `prompt_ids`")
        return _engine_generation(
            model, prompt_ids, prompt_mask, seeds, config=config, eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
    with evaluating(model), fused_activations(model):
        tokens, alive, logprobs = _decode(
            model,
            prompt_ids,
            prompt_mask,
            config=config,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            generator=generator,
        )
    response = torch.stack(tokens, dim=1)  # (B, R)
    action_mask = torch.stack(alive, dim=1)  # (B, R)
    return Generation(
        sequences=torch.cat([prompt_ids, response], dim=1),  # (B, T)
        attention_mask=torch.cat([prompt_mask.long(), action_mask.long()], dim=1),  # (B, T)
        action_mask=action_mask,
        logprobs=torch.stack(logprobs, dim=1),  # (B, R)
    )


def _engine_generation(
    policy: ExternalSampler,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    seeds: list[int],
    *,
    config: SamplingConfig,
    eos_token_id: int | None,
    pad_token_id: int,
) -> Generation:
    """Sample each row in the engine (choice 5), laid out as :func:`_decode`'s rows are: responses padded on the
    right with ``pad_token_id`` up to the longest one, action mask False there, log-probs 0 there."""
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]
    responses, response_logprobs = policy.sample(
        prompts, [int(seed) for seed in seeds], config=config, eos_token_id=eos_token_id
    )
    length = max(len(response) for response in responses)
    batch = len(responses)
    response = torch.full((batch, length), pad_token_id, dtype=prompt_ids.dtype)  # (B, R)
    action_mask = torch.zeros(batch, length, dtype=torch.bool)  # (B, R)
    logprobs = torch.zeros(batch, length, dtype=torch.float32)  # (B, R)
    for row, (tokens, values) in enumerate(zip(responses, response_logprobs, strict=True)):
        response[row, : len(tokens)] = torch.tensor(tokens, dtype=prompt_ids.dtype)
        action_mask[row, : len(tokens)] = True
        logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    device = prompt_ids.device
    action_mask = action_mask.to(device)
    return Generation(
        sequences=torch.cat([prompt_ids, response.to(device)], dim=1),  # (B, T)
        attention_mask=torch.cat([prompt_mask.long(), action_mask.long()], dim=1),  # (B, T)
        action_mask=action_mask,
        logprobs=logprobs.to(device),
    )


def sample_candidates(
    model: PreTrainedModel | ExternalSampler,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    num_samples: int,
    config: SamplingConfig,
    eos_token_id: int | None,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    seeds: list[int] | None = None,
) -> Generation:
    """``num_samples`` (N) responses per prompt; rows ``i*N .. i*N + N - 1`` belong to prompt ``i``.

    Args:
        seeds: for the engine, one seed per response (B * N), see :func:`generate`.

    Shapes:
        prompt_ids, prompt_mask: (B, P); returns :class:`Generation` with B * N rows.
    """
    if num_samples <= 0:
        raise ValueError(f"`num_samples` must be positive, got {num_samples}")
    repeats = num_samples
    return generate(
        model,
        prompt_ids.repeat_interleave(repeats, dim=0),  # (B * N, P)
        prompt_mask.repeat_interleave(repeats, dim=0),  # (B * N, P)
        config=config,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        generator=generator,
        seeds=seeds,
    )
