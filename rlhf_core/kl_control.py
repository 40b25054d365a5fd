"""KL coefficient controllers: fixed, and the adaptive controller of Ziegler et al. 2019.

The adaptive rule: ``e = clip(kl / target - 1, -0.2, 0.2)``;
``kl_coef <- kl_coef * (1 + e * n_steps / horizon)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        """Keep the coefficient; returns it."""
        del current_kl, n_steps
        return self.value


@dataclass(slots=True)
class AdaptiveKLController:
    """Proportional controller that steers the measured KL toward ``target``.

    References:
        Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", section 2.2.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"`target` and `horizon` must be positive, got {self.target} and {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient after ``n_steps`` samples measured ``current_kl``; returns it."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value
