"""Typed, frozen configuration: one dataclass per stage, validated once in ``__post_init__``.

Defaults follow the sources noted on each field; the embedded demo overrides some in ``configs/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from rlhf_core.losses import LossAggregation
from rlhf_core.rewards import KLEstimator

Estimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"]
"""Advantage estimators (:mod:`rlhf_core.gae`, :mod:`rlhf_core.advantages`). Named here, not beside their
maths, so that a stage importing the config does not import (and fingerprint) the estimators' code."""
GROUP_ESTIMATORS: tuple[Estimator, ...] = ("grpo", "dr_grpo", "rloo")
"""Estimators whose baseline is the other samples of the same prompt: they need groups of at least 2."""
CRITIC_ESTIMATORS: tuple[Estimator, ...] = ("gae",)
"""Estimators that need a value model (a critic)."""
KLPlacement = Literal["reward", "loss"]
"""Where the KL to the reference acts: the shaped reward, or the policy loss."""


def exact_div(numerator: int, denominator: int, *, what: str) -> int:
    """``numerator // denominator``, refusing a remainder with a message naming ``what``."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{what}: {denominator} must divide {numerator}")
    return numerator // denominator


def _require_positive(**values: float | int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"`{name}` must be positive, got {value}")


def _require_unit_interval(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"`{name}` must lie in [0, 1], got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingConfig:
    """How responses are sampled (stages: sample candidates, rollout, evaluate)."""

    max_new_tokens: int = 32
    """Longest response, in tokens; longer ones are truncated (and scored at their last token)."""
    temperature: float = 1.0
    """Softmax temperature; log-probs use the same one (TRL, OpenRLHF)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all (pure sampling, as PPO theory assumes)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 keeps all."""
    batch_size: int = 64
    """Prompts generated together (each with all its samples)."""

    def __post_init__(self) -> None:
        _require_positive(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            batch_size=self.batch_size,
        )
        if self.top_k < 0:
            raise ValueError(f"`top_k` must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"`top_p` must lie in (0, 1], got {self.top_p}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardModelConfig:
    """Reward-model training over preference pairs (stage: train reward model)."""

    learning_rate: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    epochs: int = 2
    """Passes over the training pairs."""
    batch_size: int = 32
    """Pairs per optimizer step."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    eval_fraction: float = 0.1
    """Share of pairs held out for accuracy."""
    use_margin: bool = True
    """Subtract each pair's margin in the Bradley-Terry loss (Llama 2)."""
    train: bool = True
    """Train the reward model on the collected pairs. False uses a pretrained one as it is (no pairs are
    collected): only with a pretrained reward model."""

    def __post_init__(self) -> None:
        _require_positive(
            learning_rate=self.learning_rate,
            epochs=self.epochs,
            batch_size=self.batch_size,
            max_grad_norm=self.max_grad_norm,
        )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"`eval_fraction` must lie in (0, 1), got {self.eval_fraction}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvantageConfig:
    """Rewards, KL and advantages (stage: compute advantages). Pure: replaying with new values is cheap."""

    estimator: Estimator = "gae"
    """Advantage estimator: gae (with a critic), or critic-free grpo, dr_grpo, rloo (groups of samples of a
    prompt, `sizes.samples_per_prompt` >= 2) or reinforce_pp (see rlhf_core.advantages)."""
    kl_coef: float = 0.05
    """KL penalty weight beta in the reward (TRL default 0.05); the adaptive controller's start with `kl_target`."""
    kl_estimator: KLEstimator = "k1"
    """Per-token KL estimator in the reward: k1, k2 or k3."""
    kl_in: KLPlacement = "reward"
    """Where the KL to the reference acts: `reward` (shaped per-token reward, weight `kl_coef`) or `loss` (k3 term
    in the policy loss, weight `ppo.kl_loss_coef`, GRPO style)."""
    kl_target: float | None = None
    """Turns on the adaptive KL controller (Ziegler et al. 2019): `kl_coef` moves to hold the rollouts' KL to the
    reference (nats per response) near this. None keeps `kl_coef` fixed."""
    kl_horizon: int = 10000
    """Rollouts the adaptive controller takes to correct by its clipped error (Ziegler et al. 2019; TRL 10000)."""
    gamma: float = 1.0
    """Discount of GAE and REINFORCE++ (TRL and OpenRLHF use 1.0 for language); the group estimators use 1."""
    gae_lambda: float = 0.95
    """GAE lambda (TRL default 0.95); GAE only."""
    score_clip: float | None = None
    """Clip scores to [-score_clip, score_clip] before shaping."""
    normalize_scores: bool = True
    """Standardise reward-model scores with the reward model's held-out mean and std (a reward function's
    scores are used as they are)."""

    def __post_init__(self) -> None:
        if self.estimator not in get_args(Estimator):
            raise ValueError(f"`estimator` must be one of {get_args(Estimator)}, got {self.estimator!r}")
        if self.kl_coef < 0:
            raise ValueError(f"`kl_coef` must be non-negative, got {self.kl_coef}")
        if self.kl_estimator not in get_args(KLEstimator):
            raise ValueError(f"`kl_estimator` must be one of {get_args(KLEstimator)}, got {self.kl_estimator!r}")
        if self.kl_in not in get_args(KLPlacement):
            raise ValueError(f"`kl_in` must be one of {get_args(KLPlacement)}, got {self.kl_in!r}")
        if self.kl_target is not None:
            _require_positive(kl_target=self.kl_target)
            if self.kl_in != "reward":
                raise ValueError("`kl_target` adapts the KL coefficient of the reward: it needs `kl_in` = 'reward'")
        _require_positive(kl_horizon=self.kl_horizon)
        _require_unit_interval(gamma=self.gamma, gae_lambda=self.gae_lambda)
        if self.score_clip is not None:
            _require_positive(score_clip=self.score_clip)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a value model (only GAE does)."""
        return self.estimator in CRITIC_ESTIMATORS

    @property
    def reward_kl_coef(self) -> float:
        """The KL weight in the reward: ``kl_coef``, or 0 when the KL acts in the loss instead."""
        return self.kl_coef if self.kl_in == "reward" else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PPOConfig:
    """The PPO update of actor and critic (stage: ppo update)."""

    epochs: int = 4
    """Passes over the experience (TRL ``num_ppo_epochs`` 4)."""
    minibatch_size: int = 16
    """Rollouts per optimizer step."""
    actor_learning_rate: float = 1e-5
    """Actor AdamW learning rate."""
    critic_learning_rate: float = 1e-5
    """Critic AdamW learning rate."""
    clip_eps: float = 0.2
    """Policy ratio clip epsilon (Schulman et al. 2017)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (Ye et al. 2020), or None."""
    value_clip_eps: float | None = 0.2
    """Value clip around rollout values, or None."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip for each model."""
    target_kl: float | None = None
    """Stop the update early once the running approximate KL exceeds this."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the whole experience before minibatching (critic-free estimators normalise their
    own, see rlhf_core.advantages)."""
    aggregation: LossAggregation = "token_mean"
    """Token-level loss aggregation: token_mean, sequence_mean, or token_sum_norm (each response's token sum over
    the generation budget `sampling.max_new_tokens`, as Dr. GRPO)."""
    kl_loss_coef: float = 0.0
    """Weight of the k3 KL to the reference in the policy loss (GRPO's beta; DeepSeekMath 0.04); needs
    `advantages.kl_in` = loss."""

    def __post_init__(self) -> None:
        _require_positive(
            epochs=self.epochs,
            minibatch_size=self.minibatch_size,
            actor_learning_rate=self.actor_learning_rate,
            critic_learning_rate=self.critic_learning_rate,
            clip_eps=self.clip_eps,
            max_grad_norm=self.max_grad_norm,
        )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"`dual_clip` must be greater than 1, got {self.dual_clip}")
        if self.value_clip_eps is not None:
            _require_positive(value_clip_eps=self.value_clip_eps)
        if self.target_kl is not None:
            _require_positive(target_kl=self.target_kl)
        if self.aggregation not in get_args(LossAggregation):
            raise ValueError(f"`aggregation` must be one of {get_args(LossAggregation)}, got {self.aggregation!r}")
        if self.kl_loss_coef < 0:
            raise ValueError(f"`kl_loss_coef` must be non-negative, got {self.kl_loss_coef}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021) on every trained model, through peft (stages: initialize, train reward model).

    The base weights stay frozen (in the precision's dtype) and are never saved again: a stage output
    holds the adapters (and heads). The reference policy is the actor with its adapters switched off.
    """

    r: int = 8
    """Adapter rank (peft's default)."""
    alpha: int = 16
    """Scaling numerator: updates are scaled by alpha / r (2 at the defaults, as TRL's PPO examples)."""
    dropout: float = 0.05
    """Dropout on the adapter input during reward-model training (off in the PPO update, as all dropout)."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """Modules that get adapters: peft's ``all-linear`` (every linear layer but the output layer) or names."""

    def __post_init__(self) -> None:
        _require_positive(r=self.r, alpha=self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must lie in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module, or be 'all-linear'")
