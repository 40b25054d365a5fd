"""Masked mean, variance and whitening: hand values, hypothesis properties and the empty-mask errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlhf_core.masked import masked_mean, masked_sum, masked_var, masked_whiten

EXACT = dict(rtol=0.0, atol=0.0)
# Derandomised so that the suite gives the same verdict on every run.
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

# The worked example: valid values 1, 2 and 4; everything else is padding.
VALUES = torch.tensor([[1.0, 2.0, 30.0], [4.0, -50.0, 60.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, False, False]])


# ----------------------------------------------------------------------------- hand values


def test_masked_mean_by_hand():
    # (1 + 2 + 4) / 3 = 7/3; the padding (30, -50, 60) is ignored.
    torch.testing.assert_close(masked_mean(VALUES, MASK), torch.tensor(7 / 3, dtype=torch.float64), **EXACT)


def test_masked_mean_along_a_dimension_by_hand():
    # row 0: (1 + 2) / 2 = 1.5; row 1: 4 / 1 = 4.
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=1), torch.tensor([1.5, 4.0], dtype=torch.float64))
    # columns: (1 + 4) / 2 = 2.5; 2 / 1 = 2; no valid element gives 0 (not NaN).
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=0), torch.tensor([2.5, 2.0, 0.0], dtype=torch.float64))


def test_masked_sum_by_hand():
    # everything: 1 + 2 + 4 = 7; rows: 1 + 2 = 3 and 4; columns: 1 + 4 = 5, 2, and 0 where none is valid.
    torch.testing.assert_close(masked_sum(VALUES, MASK), torch.tensor(7.0, dtype=torch.float64), **EXACT)
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=1), torch.tensor([3.0, 4.0], dtype=torch.float64), **EXACT)
    torch.testing.assert_close(
        masked_sum(VALUES, MASK, dim=0), torch.tensor([5.0, 2.0, 0.0], dtype=torch.float64), **EXACT
    )


def test_masked_var_by_hand():
    # mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9 = 14/3.
    # unbiased: (14/3) / (3 - 1) = 7/3; biased: (14/3) / 3 = 14/9.
    torch.testing.assert_close(masked_var(VALUES, MASK), torch.tensor(7 / 3, dtype=torch.float64))
    torch.testing.assert_close(masked_var(VALUES, MASK, unbiased=False), torch.tensor(14 / 9, dtype=torch.float64))


def test_masked_whiten_by_hand():
    # (x - 7/3) / sqrt(7/3) at the valid positions, 0 elsewhere.
    std = math.sqrt(7 / 3)
    expected = torch.tensor(
        [[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(masked_whiten(VALUES, MASK, eps=0.0), expected, rtol=1e-12, atol=1e-12)


def test_masked_whiten_without_mean_shift_keeps_the_mean():
    # Scaled deviations plus the mean 7/3: the valid mean stays 7/3, the unbiased std becomes 1.
    std = math.sqrt(7 / 3)
    expected = torch.tensor(
        [[(1 - 7 / 3) / std + 7 / 3, (2 - 7 / 3) / std + 7 / 3, 0.0], [(4 - 7 / 3) / std + 7 / 3, 0.0, 0.0]],
        dtype=torch.float64,
    )
    whitened = masked_whiten(VALUES, MASK, shift_mean=False, eps=0.0)
    torch.testing.assert_close(whitened, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(masked_mean(whitened, MASK), torch.tensor(7 / 3, dtype=torch.float64))


def test_integer_mask_works_like_a_bool_mask():
    assert masked_mean(VALUES, MASK.long()).item() == masked_mean(VALUES, MASK).item()
    assert masked_var(VALUES, MASK.long()).item() == masked_var(VALUES, MASK).item()


def test_inputs_are_not_modified():
    values, mask = VALUES.clone(), MASK.clone()
    masked_whiten(values, mask)
    masked_var(values, mask)
    torch.testing.assert_close(values, VALUES, **EXACT)
    assert torch.equal(mask, MASK)


# ----------------------------------------------------------------------------- errors


def test_masked_mean_of_an_empty_mask_is_an_error():
    with pytest.raises(ValueError, match="`mask` selects no element"):
        masked_mean(VALUES, torch.zeros_like(MASK))


@pytest.mark.parametrize("count", [0, 1])
def test_unbiased_masked_var_needs_two_elements(count):
    mask = torch.zeros_like(MASK)
    mask.view(-1)[:count] = True
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(VALUES, mask)
    with pytest.raises(ValueError, match="at least 2" if count else "selects no element"):
        masked_whiten(VALUES, mask)


def test_biased_masked_var_needs_one_element():
    with pytest.raises(ValueError, match="at least 1"):
        masked_var(VALUES, torch.zeros_like(MASK), unbiased=False)
    one = torch.zeros_like(MASK)
    one[1, 0] = True
    torch.testing.assert_close(masked_var(VALUES, one, unbiased=False), torch.tensor(0.0, dtype=torch.float64))


# ----------------------------------------------------------------------------- properties


@st.composite
def masked_tensors(draw, *, min_valid: int = 2):
    """(values, other values, mask) in float64; ``other`` differs from ``values`` only where ``mask`` is False."""
    rows = draw(st.integers(1, 4))
    columns = draw(st.integers(1, 6))
    finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
    values = torch.tensor(draw(st.lists(finite, min_size=rows * columns, max_size=rows * columns)), dtype=torch.float64)
    garbage = torch.tensor(
        draw(st.lists(st.floats(-1e6, 1e6), min_size=rows * columns, max_size=rows * columns)), dtype=torch.float64
    )
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=rows * columns, max_size=rows * columns)))
    assume(int(mask.sum()) >= min_valid)
    values, garbage, mask = values.view(rows, columns), garbage.view(rows, columns), mask.view(rows, columns)
    return values, torch.where(mask, values, garbage), mask


@PROPERTY_SETTINGS
@given(masked_tensors())
def test_values_at_masked_positions_never_matter(data):
    values, other, mask = data
    torch.testing.assert_close(masked_mean(values, mask), masked_mean(other, mask), **EXACT)
    torch.testing.assert_close(masked_mean(values, mask, dim=1), masked_mean(other, mask, dim=1), **EXACT)
    torch.testing.assert_close(masked_sum(values, mask, dim=1), masked_sum(other, mask, dim=1), **EXACT)
    torch.testing.assert_close(masked_var(values, mask), masked_var(other, mask), **EXACT)
    torch.testing.assert_close(masked_whiten(values, mask), masked_whiten(other, mask), **EXACT)


@PROPERTY_SETTINGS
@given(masked_tensors(), st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_non_finite_values_at_masked_positions_never_leak(data, poison):
    values, _, mask = data
    assume(not bool(mask.all()))
    poisoned = values.masked_fill(~mask, poison)
    torch.testing.assert_close(masked_mean(values, mask), masked_mean(poisoned, mask), **EXACT)
    torch.testing.assert_close(masked_sum(values, mask, dim=1), masked_sum(poisoned, mask, dim=1), **EXACT)
    torch.testing.assert_close(masked_var(values, mask), masked_var(poisoned, mask), **EXACT)
    torch.testing.assert_close(masked_whiten(values, mask), masked_whiten(poisoned, mask), **EXACT)


@PROPERTY_SETTINGS
@given(masked_tensors())
def test_reductions_equal_the_naive_boolean_index(data):
    values, _, mask = data
    torch.testing.assert_close(masked_mean(values, mask), values[mask].mean(), rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(masked_var(values, mask), values[mask].var(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        masked_var(values, mask, unbiased=False), values[mask].var(unbiased=False), rtol=1e-9, atol=1e-9
    )
    naive_rows = torch.stack(
        [
            row[row_mask].mean() if row_mask.any() else row.new_zeros(())
            for row, row_mask in zip(values, mask, strict=True)
        ]
    )
    torch.testing.assert_close(masked_mean(values, mask, dim=1), naive_rows, rtol=1e-12, atol=1e-9)


@PROPERTY_SETTINGS
@given(masked_tensors())
def test_whitened_values_have_mean_zero_and_unit_unbiased_variance(data):
    values, _, mask = data
    variance = float(values[mask].var())
    assume(variance > 1e-6)
    whitened = masked_whiten(values, mask, eps=0.0)
    torch.testing.assert_close(whitened[mask].mean(), torch.tensor(0.0, dtype=torch.float64), rtol=0, atol=1e-9)
    torch.testing.assert_close(whitened[mask].var(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-9)
    assert bool((whitened[~mask] == 0).all())
    # The default eps = 1e-8 only shrinks the variance to var / (var + eps).
    default = masked_whiten(values, mask)
    expected = torch.tensor(variance / (variance + 1e-8), dtype=torch.float64)
    torch.testing.assert_close(default[mask].var(), expected, rtol=0, atol=1e-9)


def test_gradient_of_masked_mean_is_one_over_count_at_valid_positions_and_zero_elsewhere():
    # d/dx_i of (1/n) sum_valid x = 1/n for valid i (n = 3 here), 0 for padding, even NaN padding.
    values = VALUES.masked_fill(~MASK, float("nan")).requires_grad_(True)
    masked_mean(values, MASK).backward()
    expected = MASK.to(torch.float64) / 3
    torch.testing.assert_close(values.grad, expected, **EXACT)
