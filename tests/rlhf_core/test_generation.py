"""Sampling from GPT-2, Llama and Qwen2 (tiny, random init): seeds, log-probs, padding, EOS, top-k/top-p, N per prompt."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.config import SamplingConfig
from rlhf_core.generation import filter_logits, generate, sample_candidates, sample_tokens
from rlhf_core.sequences import action_mask_from_tokens, position_ids_from_mask, response_logprobs
from tests.conftest import EOS, PAD, TINY_VOCAB, left_padded, tiny_causal_lm

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10]]
LOGPROB_TOLERANCE = dict(rtol=0.0, atol=1e-5)


@pytest.fixture(scope="module")
def models():
    """One tiny causal LM per architecture, built once for the module."""
    return {}


@pytest.fixture
def model(arch, models):
    if arch not in models:
        models[arch] = tiny_causal_lm(arch, seed=0).eval()
    return models[arch]


def run(model, prompts=PROMPTS, *, seed: int | None = 0, eos: int | None = EOS, **sampling):
    ids, mask = left_padded(prompts)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    config = SamplingConfig(**{"max_new_tokens": 6, **sampling})
    return generate(model, ids, mask, config=config, eos_token_id=eos, pad_token_id=PAD, generator=generator)


def training_logprobs(model, sequences, attention_mask, prompt_length, temperature):
    """The training-time forward: one pass over the whole sequence, positions from the mask."""
    with torch.no_grad():
        logits = model(
            input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        ).logits
    return response_logprobs(logits, sequences, prompt_length, temperature=temperature)


def test_shapes_and_masks(model):
    generation = run(model, max_new_tokens=6, temperature=1.0)
    batch, prompt_length = 3, 5
    response_length = generation.action_mask.shape[1]
    assert 1 <= response_length <= 6
    assert generation.sequences.shape == (batch, prompt_length + response_length)
    assert generation.attention_mask.shape == generation.sequences.shape
    assert generation.logprobs.shape == generation.action_mask.shape == (batch, response_length)
    assert generation.action_mask.dtype == torch.bool and generation.logprobs.dtype == torch.float32
    ids, mask = left_padded(PROMPTS)
    assert torch.equal(generation.sequences[:, :prompt_length], ids)
    assert torch.equal(generation.attention_mask[:, :prompt_length], mask)
    assert torch.equal(generation.attention_mask[:, prompt_length:], generation.action_mask.long())
    assert bool((generation.logprobs[~generation.action_mask] == 0).all())
    assert bool((generation.logprobs[generation.action_mask] < 0).all())


def test_without_eos_every_row_runs_to_max_new_tokens(model):
    generation = run(model, eos=None, max_new_tokens=7)
    assert generation.action_mask.shape == (3, 7) and bool(generation.action_mask.all())


def test_same_seed_same_samples_and_different_seed_different_samples(model):
    first = run(model, seed=123, eos=None, max_new_tokens=8)
    again = run(model, seed=123, eos=None, max_new_tokens=8)
    other = run(model, seed=124, eos=None, max_new_tokens=8)
    assert torch.equal(first.sequences, again.sequences)
    torch.testing.assert_close(first.logprobs, again.logprobs, rtol=0.0, atol=0.0)
    assert not torch.equal(first.sequences, other.sequences)


def test_generation_leaves_the_training_mode_as_it_was(model):
    model.train()
    try:
        run(model)
        assert model.training
    finally:
        model.eval()
    run(model)
    assert not model.training


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_generation_logprobs_equal_a_training_time_forward(model, temperature):
    generation = run(model, temperature=temperature, max_new_tokens=8)
    expected = training_logprobs(model, generation.sequences, generation.attention_mask, 5, temperature)
    expected = expected * generation.action_mask
    torch.testing.assert_close(generation.logprobs, expected, **LOGPROB_TOLERANCE)
    # ... and they do depend on the temperature: the forward at temperature 1 differs.
    untempered = training_logprobs(model, generation.sequences, generation.attention_mask, 5, 1.0)
    assert (untempered - expected)[generation.action_mask].abs().max().item() > 1e-3


def test_left_padding_changes_no_logprob(model):
    # Each batched row, stripped of its prompt padding and scored alone, gives the same log-probs.
    generation = run(model, temperature=0.7, eos=None, max_new_tokens=6)
    for row, prompt in enumerate(PROMPTS):
        alone = torch.cat([torch.tensor(prompt), generation.sequences[row, 5:]])[None]  # (1, len + R)
        logprobs = training_logprobs(model, alone, torch.ones_like(alone), len(prompt), 0.7)
        torch.testing.assert_close(logprobs[0], generation.logprobs[row], **LOGPROB_TOLERANCE)


def test_left_padding_changes_no_greedy_sample(model):
    # Greedy (top_k = 1) does not consume the random stream differently per row, so a prompt
    # alone and the same prompt left-padded in a batch must give the same tokens and log-probs.
    batched = run(model, seed=None, eos=None, top_k=1, temperature=0.7, max_new_tokens=6)
    for row, prompt in enumerate(PROMPTS):
        alone = run(model, [prompt], seed=None, eos=None, top_k=1, temperature=0.7, max_new_tokens=6)
        assert torch.equal(alone.sequences[0, len(prompt) :], batched.sequences[row, 5:])
        torch.testing.assert_close(alone.logprobs[0], batched.logprobs[row], **LOGPROB_TOLERANCE)


def test_top_k_one_is_greedy(model):
    first = run(model, seed=1, eos=None, top_k=1, max_new_tokens=6)
    second = run(model, seed=2, eos=None, top_k=1, max_new_tokens=6)
    assert torch.equal(first.sequences, second.sequences)
    with torch.no_grad():
        logits = model(
            input_ids=first.sequences,
            attention_mask=first.attention_mask,
            position_ids=position_ids_from_mask(first.attention_mask),
        ).logits
    # Response token t sits at column 5 + t and is the argmax of the logits at column 4 + t.
    assert torch.equal(first.sequences[:, 5:], logits[:, 4:-1].argmax(dim=-1))
    # A tiny nucleus keeps only the most likely token: also greedy.
    nucleus = run(model, seed=3, eos=None, top_p=1e-4, max_new_tokens=6)
    assert torch.equal(nucleus.sequences, first.sequences)


def test_eos_stops_a_row_and_everything_after_is_padding(model):
    # Pick as EOS the token that greedy decoding emits at step 2 of row 0 (no EOS set): row 0
    # must then stop right there, every row at its own first occurrence of that token.
    free = run(model, seed=None, eos=None, top_k=1, max_new_tokens=6)
    response = free.sequences[:, 5:]
    eos = int(response[0, 2])
    stopped = run(model, seed=None, eos=eos, top_k=1, max_new_tokens=6)
    length = stopped.action_mask.shape[1]
    expected_mask = action_mask_from_tokens(response, eos_token_id=eos)[:, :length]
    assert torch.equal(stopped.action_mask, expected_mask)
    assert stopped.action_mask[0].sum().item() == int((response[0] == eos).long().argmax()) + 1
    # Tokens up to EOS are the free-running ones; everything after is PAD with attention 0.
    new_tokens = stopped.sequences[:, 5:]
    assert torch.equal(new_tokens[stopped.action_mask], response[:, :length][stopped.action_mask])
    assert bool((new_tokens[~stopped.action_mask] == PAD).all())
    assert bool((stopped.attention_mask[:, 5:][~stopped.action_mask] == 0).all())
    assert bool((stopped.logprobs[~stopped.action_mask] == 0).all())
    # The loop ends as soon as every row has finished: some row is still acting in the last column.
    full_mask = action_mask_from_tokens(response, eos_token_id=eos)  # (B, 6)
    finished_everywhere = bool((response == eos).any(dim=1).all())
    assert length == (int(full_mask.sum(dim=1).max()) if finished_everywhere else 6)
    assert bool(stopped.action_mask[:, -1].any())


def test_sampled_eos_rows_are_padded_with_false_action_mask(model):
    # Sampling at a high temperature over many rows: some rows hit the real EOS id early.
    generation = run(model, [[3, 4]] * 40, seed=0, temperature=3.0, max_new_tokens=8)
    response = generation.sequences[:, 2:]
    assert torch.equal(generation.action_mask, action_mask_from_tokens(response, eos_token_id=EOS))
    finished = (response == EOS).any(dim=1)
    assert bool(finished.any()), "no row emitted EOS; raise the row count"
    assert bool((response[~generation.action_mask] == PAD).all())


def test_sampling_follows_softmax_over_temperature_then_top_k_and_top_p(model):
    # One new token for 4000 copies of a prompt: empirical frequencies match the model's
    # distribution softmax(logits / T), restricted and renormalised to the top-k / nucleus set.
    copies = 4000
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]  # (V,)
    for options in (dict(temperature=0.5), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.6)):
        config = SamplingConfig(max_new_tokens=1, **options)
        generation = generate(
            model,
            ids.expand(copies, -1),
            torch.ones(copies, 3, dtype=torch.long),
            config=config,
            eos_token_id=None,
            pad_token_id=PAD,
            generator=torch.Generator().manual_seed(7),
        )
        filtered = filter_logits(logits[None] / options["temperature"], top_k=config.top_k, top_p=config.top_p)[0]
        expected = torch.softmax(filtered, dim=-1)
        observed = torch.bincount(generation.sequences[:, -1], minlength=TINY_VOCAB).float() / copies
        assert bool((observed[expected == 0] == 0).all()), options  # nothing outside the kept set
        torch.testing.assert_close(observed, expected, rtol=0.0, atol=0.03)


def test_sample_candidates_gives_n_rows_per_prompt_in_order(model):
    ids, mask = left_padded(PROMPTS)
    config = SamplingConfig(max_new_tokens=5)
    generation = sample_candidates(
        model, ids, mask, num_samples=4, config=config, eos_token_id=None, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert generation.sequences.shape == (12, 10)
    for row in range(12):
        assert torch.equal(generation.sequences[row, :5], ids[row // 4])
        assert torch.equal(generation.attention_mask[row, :5], mask[row // 4])
    for prompt in range(3):  # samples of one prompt differ from each other (with overwhelming probability)
        assert len({tuple(r.tolist()) for r in generation.sequences[prompt * 4 : prompt * 4 + 4]}) > 1
    # Greedy: the N rows of a prompt are identical and equal to generating that prompt once.
    greedy = SamplingConfig(max_new_tokens=5, top_k=1)
    candidates = sample_candidates(model, ids, mask, num_samples=3, config=greedy, eos_token_id=None, pad_token_id=PAD)
    single = generate(model, ids, mask, config=greedy, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(candidates.sequences, single.sequences.repeat_interleave(3, dim=0))


def test_bad_prompts_are_errors(model):
    ids, mask = left_padded(PROMPTS)
    config = SamplingConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one real token"):
        generate(model, ids, mask * torch.tensor([[1], [0], [1]]), config=config, eos_token_id=None, pad_token_id=PAD)
    with pytest.raises(ValueError, match="must be equal 2-D shapes"):
        generate(model, ids, mask[:, 1:], config=config, eos_token_id=None, pad_token_id=PAD)
    right_ids, right_mask = torch.tensor([[3, 4, PAD], [5, 6, 7]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="must be left-padded"):
        generate(model, right_ids, right_mask, config=config, eos_token_id=None, pad_token_id=PAD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_seed_samples_the_same_tokens_on_cpu_and_cuda(model):
    # The uniforms come from a CPU generator, so the device only changes float rounding.
    ids, mask = left_padded(PROMPTS)
    config = SamplingConfig(max_new_tokens=6)
    on_cpu = generate(model, ids, mask, config=config, eos_token_id=None, pad_token_id=PAD,
                      generator=torch.Generator().manual_seed(3))  # fmt: skip
    gpu_model = copy.deepcopy(model).cuda()
    on_gpu = generate(gpu_model, ids.cuda(), mask.cuda(), config=config, eos_token_id=None, pad_token_id=PAD,
                      generator=torch.Generator().manual_seed(3))  # fmt: skip
    assert torch.equal(on_gpu.sequences.cpu(), on_cpu.sequences)
    torch.testing.assert_close(on_gpu.logprobs.cpu(), on_cpu.logprobs, rtol=0.0, atol=1e-4)


# ----------------------------------------------------------------------------- sample_tokens (no model)


def reference_inverse_cdf(probabilities: torch.Tensor, uniform: float) -> int:
    """The docstring's loop: the first token whose running sum exceeds u * total."""
    total, running = float(probabilities.double().sum()), 0.0
    for token, probability in enumerate(probabilities.double().tolist()):
        running += probability
        if running > uniform * total:
            return token
    return len(probabilities) - 1


def test_sample_tokens_equals_the_reference_loop():
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.rand(64, 50, generator=generator) ** 3  # unnormalised, uneven
    probabilities[:, ::7] = 0.0  # some tokens impossible
    uniforms = torch.rand(64, generator=generator)
    drawn = sample_tokens(probabilities, uniforms)
    expected = [reference_inverse_cdf(row, float(u)) for row, u in zip(probabilities, uniforms, strict=True)]
    assert drawn.tolist() == expected
    assert bool((probabilities[torch.arange(64), drawn] > 0).all())


def test_sample_tokens_never_draws_an_impossible_token_at_the_edges():
    probabilities = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.3, 0.0, 0.0, 0.7]])
    for uniform in (0.0, 1e-12, 0.5, 1.0 - 2**-24):
        drawn = sample_tokens(probabilities, torch.full((2,), uniform))
        assert bool((probabilities[torch.arange(2), drawn] > 0).all()), uniform
    # u = 0 takes the first possible token, u -> 1 the last.
    assert sample_tokens(probabilities, torch.zeros(2)).tolist() == [1, 0]
    assert sample_tokens(probabilities, torch.full((2,), 1.0 - 2**-24)).tolist() == [2, 3]


def test_sample_tokens_follows_the_distribution():
    probabilities = torch.tensor([0.1, 0.0, 0.6, 0.3]).repeat(20_000, 1)
    drawn = sample_tokens(probabilities, torch.rand(20_000, generator=torch.Generator().manual_seed(1)))
    observed = torch.bincount(drawn, minlength=4).float() / 20_000
    torch.testing.assert_close(observed, probabilities[0], rtol=0.0, atol=0.01)


# ----------------------------------------------------------------------------- filter_logits (no model)


def reference_nucleus(probabilities: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches ``top_p``."""
    order = sorted(range(len(probabilities)), key=lambda i: -float(probabilities[i]))
    kept, mass = set(), 0.0
    for index in order:
        kept.add(index)
        mass += float(probabilities[index])
        if mass >= top_p:
            break
    return kept


def test_top_p_keeps_the_smallest_set_with_mass_at_least_p_by_hand():
    # Probabilities 0.05, 0.5, 0.15, 0.3 (shuffled on purpose); sorted: 0.5, 0.3, 0.15, 0.05.
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    cases = {0.45: {1}, 0.7: {1, 3}, 0.85: {1, 3, 2}, 0.99: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, kept in cases.items():
        filtered = filter_logits(logits, top_p=top_p)
        assert set(torch.isfinite(filtered[0]).nonzero().flatten().tolist()) == kept, top_p
        torch.testing.assert_close(filtered[torch.isfinite(filtered)], logits[torch.isfinite(filtered)])


def test_top_p_equals_the_reference_on_random_rows():
    generator = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(64, 12, generator=generator, dtype=torch.float64)
    for top_p in (0.1, 0.5, 0.9):
        filtered = filter_logits(logits, top_p=top_p)
        for row in range(64):
            kept = set(torch.isfinite(filtered[row]).nonzero().flatten().tolist())
            assert kept == reference_nucleus(torch.softmax(logits[row], -1), top_p)


def test_top_k_keeps_the_k_largest_and_always_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    filtered = filter_logits(logits, top_k=2)
    assert torch.isfinite(filtered).tolist() == [[False, True, False, True, False], [True, True, False, False, False]]
    assert torch.equal(filter_logits(logits, top_k=0), logits)
    assert torch.equal(filter_logits(logits, top_k=5), logits)
    both = filter_logits(logits, top_k=3, top_p=0.01)
    assert torch.isfinite(both).sum(dim=1).tolist() == [1, 1]


def test_the_preallocated_kv_cache_samples_exactly_what_the_models_own_cache_does(model, monkeypatch):
    import transformers

    import rlhf_core.generation as generation

    with_buffers = run(model, temperature=0.9)
    monkeypatch.setattr(generation, "_kv_cache", lambda model, length: transformers.DynamicCache(config=model.config))
    growing = run(model, temperature=0.9)
    for name in ("sequences", "attention_mask", "action_mask", "logprobs"):
        torch.testing.assert_close(getattr(with_buffers, name), getattr(growing, name), rtol=0.0, atol=0.0)
