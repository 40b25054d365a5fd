"""How far a rollout's critic was from the one its overlapped update starts from, by hand."""

from __future__ import annotations

import torch

from tasks.critic_values import value_shift


def test_issue42_the_value_shift_is_the_mean_absolute_difference_over_action_tokens_only():
    values = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    rollout = torch.tensor([[0.5, 3.0, 9.0], [1.0, 7.0, 7.0]])  # padding holds anything: it is not read
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # |1 - 0.5| + |2 - 3| + |-1 - 1| = 0.5 + 1 + 2 = 3.5 over 3 action tokens
    torch.testing.assert_close(value_shift(values, rollout, mask), torch.tensor(3.5 / 3))
