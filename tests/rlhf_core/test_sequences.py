"""Token bookkeeping: the logits/token off-by-one, temperature, the action mask, last tokens, positions."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.sequences import (
    action_mask_from_tokens,
    last_token_index,
    logprobs_from_logits,
    position_ids_from_mask,
    response_logprobs,
    response_slice,
    token_logprobs,
)

EXACT = dict(rtol=0.0, atol=0.0)
EOS = 2


def naive_response_logprobs(logits, sequences, prompt_length, temperature):
    """Per row and token: log_softmax of the logits one column before the token, then pick the token."""
    rows, total = sequences.shape
    out = torch.zeros(rows, total - prompt_length, dtype=torch.float64)
    for b in range(rows):
        for t in range(total - prompt_length):
            column = prompt_length + t
            distribution = torch.log_softmax(logits[b, column - 1].double() / temperature, dim=-1)
            out[b, t] = distribution[sequences[b, column]]
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("prompt_length", [1, 3])
def test_response_logprobs_equal_a_naive_log_softmax_and_gather(temperature, prompt_length):
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 7, 11, generator=generator)
    sequences = torch.randint(0, 11, (3, 7), generator=generator)
    result = response_logprobs(logits, sequences, prompt_length, temperature=temperature)
    assert result.shape == (3, 7 - prompt_length) and result.dtype == torch.float32
    expected = naive_response_logprobs(logits, sequences, prompt_length, temperature).float()
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-5)


def test_the_logits_one_column_before_a_token_score_it():
    # Prompt length 2, vocabulary 3. The logits at column 1 put all mass on token 2, which sits at column 2.
    logits = torch.full((1, 4, 3), -1e4)
    logits[0, 1, 2] = 0.0  # scores column 2
    logits[0, 2, 0] = 0.0  # scores column 3
    sequences = torch.tensor([[1, 1, 2, 0]])
    torch.testing.assert_close(response_logprobs(logits, sequences, 2), torch.zeros(1, 2), **EXACT)
    wrong = torch.tensor([[1, 1, 0, 2]])
    assert bool((response_logprobs(logits, wrong, 2) < -1e3).all())


def test_temperature_divides_the_logits():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 9, generator=generator, dtype=torch.float64)
    sequences = torch.randint(0, 9, (2, 5), generator=generator)
    torch.testing.assert_close(
        response_logprobs(logits, sequences, 2, temperature=0.5),
        response_logprobs(logits / 0.5, sequences, 2, temperature=1.0),
        rtol=1e-6,
        atol=1e-6,
    )
    # A hand value: logits (0, ln 3) at temperature 1 give p = (1/4, 3/4); at temperature 0.5
    # the logits become (0, 2 ln 3), so p = (1/10, 9/10).
    two_way = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]])
    token = torch.tensor([[1]])
    torch.testing.assert_close(logprobs_from_logits(two_way, token), torch.log(torch.tensor([[0.75]])))
    torch.testing.assert_close(logprobs_from_logits(two_way, token, temperature=0.5), torch.log(torch.tensor([[0.9]])))


def test_logprobs_are_computed_in_float32_from_half_precision_logits():
    logits = torch.randn(1, 3, 5).to(torch.bfloat16)
    tokens = torch.tensor([[0, 1, 2]])
    result = logprobs_from_logits(logits, tokens)
    assert result.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)


def test_bad_temperature_and_prompt_length_are_errors():
    logits, sequences = torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long)
    for temperature in (0.0, -1.0):
        with pytest.raises(ValueError, match="`temperature` must be positive"):
            response_logprobs(logits, sequences, 1, temperature=temperature)
    with pytest.raises(ValueError, match="`prompt_length` must be at least 1"):
        response_logprobs(logits, sequences, 0)


def test_response_slice_takes_columns_p_minus_one_to_t_minus_two():
    per_position = torch.arange(6)[None, :, None].expand(2, 6, 3)  # column index as the value
    sliced = response_slice(per_position, 2)  # P = 2, T = 6 -> R = 4, columns 1..4
    assert sliced.shape == (2, 4, 3)
    torch.testing.assert_close(sliced[0, :, 0], torch.tensor([1, 2, 3, 4]), **EXACT)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([EOS, 5, 6, 7], [True, False, False, False]),  # EOS first
        ([5, 6, 7, 8], [True, True, True, True]),  # no EOS: truncated, all tokens are actions
        ([5, 6, 7, EOS], [True, True, True, True]),  # EOS in the last slot
        ([5, EOS, 6, EOS], [True, True, False, False]),  # several EOS: the first one ends the response
        ([5, EOS, EOS, EOS], [True, True, False, False]),  # EOS used as padding after EOS
        ([5, 0, 0, 0], [True, True, True, True]),  # padding is not EOS
    ],
)
def test_action_mask_from_tokens_edge_cases(tokens, expected):
    mask = action_mask_from_tokens(torch.tensor([tokens]), eos_token_id=EOS)
    assert mask.dtype == torch.bool
    assert mask[0].tolist() == expected


def test_action_mask_rows_are_independent_and_none_eos_keeps_everything():
    response = torch.tensor([[EOS, 5, 6], [5, 6, 7], [5, EOS, 6]])
    assert action_mask_from_tokens(response, eos_token_id=EOS).tolist() == [
        [True, False, False],
        [True, True, True],
        [True, True, False],
    ]
    assert bool(action_mask_from_tokens(response, eos_token_id=None).all())


def naive_action_mask(response: torch.Tensor, eos: int) -> torch.Tensor:
    rows = []
    for row in response.tolist():
        first = row.index(eos) if eos in row else len(row) - 1
        rows.append([True] * (first + 1) + [False] * (len(row) - first - 1))
    return torch.tensor(rows)


def test_action_mask_equals_the_naive_definition_on_random_tokens():
    generator = torch.Generator().manual_seed(2)
    response = torch.randint(0, 5, (50, 6), generator=generator)  # EOS = 2 is frequent
    assert torch.equal(action_mask_from_tokens(response, eos_token_id=EOS), naive_action_mask(response, EOS))


def test_last_token_index_for_left_right_and_no_padding():
    attention_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # left padding: last column
            [1, 1, 1, 0, 0],  # right padding: column 2
            [1, 1, 1, 1, 1],  # no padding
            [0, 1, 1, 1, 0],  # both sides: column 3
            [1, 0, 0, 0, 0],  # a single token
        ]
    )
    torch.testing.assert_close(last_token_index(attention_mask), torch.tensor([4, 2, 4, 3, 0]), **EXACT)
    torch.testing.assert_close(last_token_index(attention_mask.bool()), torch.tensor([4, 2, 4, 3, 0]), **EXACT)


def test_position_ids_count_only_real_tokens():
    attention_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # left padding does not shift positions
            [1, 1, 1, 0, 0],  # right padding repeats the last position (never read)
            [0, 1, 1, 1, 0],  # prompt padding plus a finished response
            [1, 1, 1, 1, 1],
        ]
    )
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 2], [0, 1, 2, 3, 4]])
    positions = position_ids_from_mask(attention_mask)
    assert positions.dtype == torch.long
    torch.testing.assert_close(positions, expected, **EXACT)
    # Real tokens get the same positions as the unpadded sequence would.
    torch.testing.assert_close(positions[0][attention_mask[0].bool()], torch.arange(3), **EXACT)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_token_logprobs_equal_the_naive_ones_with_their_gradient(temperature):
    # 37 rows: two whole chunks of 16 and a partial one; one row with filtered (-inf) logits.
    torch.manual_seed(0)
    logits = torch.randn(37, 50, dtype=torch.float64) * 3
    logits[5, 10:] = float("-inf")
    tokens = torch.randint(0, 50, (37,))
    tokens[5] = 3
    upstream = torch.randn(37, dtype=torch.float64)

    fused_input = logits.clone().requires_grad_()
    fused = token_logprobs(fused_input, tokens, temperature=temperature)
    (fused.logprobs * upstream).sum().backward()

    naive_input = logits.clone().requires_grad_()
    log_softmax = torch.log_softmax(naive_input / temperature, dim=-1)
    naive = log_softmax.gather(-1, tokens[:, None])[:, 0]
    (naive * upstream).sum().backward()
    probabilities = log_softmax.exp()
    naive_entropy = -(probabilities * torch.where(probabilities > 0, log_softmax, 0.0)).sum(-1)

    torch.testing.assert_close(fused.logprobs, naive.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.entropy, naive_entropy.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_input.grad, naive_input.grad, atol=1e-6, rtol=1e-5)
    assert fused_input.grad[5, 10:].eq(0).all()  # a filtered token gets no gradient
    assert not fused.entropy.requires_grad


def test_fused_token_logprobs_keep_the_leading_shape():
    logits = torch.randn(2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3))
    result = token_logprobs(logits, tokens)
    assert result.logprobs.shape == result.entropy.shape == (2, 3)
    torch.testing.assert_close(result.logprobs, logprobs_from_logits(logits, tokens))
