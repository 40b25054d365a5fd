"""Typed, frozen configuration: one dataclass per stage, validated once in ``__post_init__``.

Defaults follow the sources noted on each field; the embedded demo overrides some in ``configs/``.
A numeric field's range is declared with the field (:func:`bounded`), the one place it is written:
``__post_init__`` refuses a value outside it, and NaN or infinity in any numeric field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any, Literal, get_args

KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token KL estimators (:func:`rlhf_core.rewards.kl_estimate`)."""
LossAggregation = Literal["token_mean", "sequence_mean", "token_sum_norm"]
"""How token losses become one loss (:func:`rlhf_core.losses.aggregate`)."""
Precision = Literal["fp32", "bf16", "fp16"]
"""Numeric precision of forward passes (:mod:`rlhf_core.precision`)."""
DeviceChoice = Literal["auto", "cpu", "cuda"]
"""Where models run (:func:`rlhf_core.precision.resolve_device`)."""
OffPolicyCorrection = Literal["decoupled", "behaviour"]
"""How the PPO update corrects for rows sampled by an older policy (``sampling.staleness``; :mod:`rlhf_core.off_policy`)."""
GenerationEngine = Literal["hf", "vllm"]
"""What samples responses (:func:`rlhf_core.generation.generate`): our KV-cache loop, or a vLLM engine."""
UpdateName = Literal["ppo", "dpo"]
"""What an iteration's update learns from: rollouts scored by a reward (``ppo``, every advantage estimator), or the
iteration's labelled pairs directly (``dpo``: a direct preference update, no reward model, rollout or advantages)."""
PreferenceLoss = Literal["sigmoid", "ipo", "simpo"]
"""The direct preference losses (:func:`rlhf_core.preference_losses.preference_loss`): DPO's sigmoid (with cDPO label
smoothing), IPO, SimPO."""
LabelerName = Literal["gold", "import", "reward_model", "human", "function"]
"""Who labels candidate pairs (``tasks.labelers``): a gold judge, an imported file, the current reward model, or a
person."""
Pairing = Literal["consecutive", "best_vs_worse", "all_decisive"]
"""Which of a prompt's candidates are paired (``tasks.pairing``): consecutive ones, the best against a worse one
(UltraFeedback's binarised pairs), or every pair with a winner."""
SCORING_LABELERS: tuple[LabelerName, ...] = ("gold", "function")
"""Labelers that score each candidate alone, so comparing every pair of a prompt's candidates is cheap and
consistent: the only ones a pairing other than ``consecutive`` may use."""
MIN_PREFERENCE_PAIRS = 4
"""The fewest preference pairs a campaign's iteration is configured to collect (fewer may be decisive)."""


def held_out_pairs(pairs: int, eval_fraction: float) -> int:
    """How many of the first ``pairs`` preference pairs are held out for the reward model's accuracy:
    ``ceil(pairs * eval_fraction)``, on the fraction as written (0.1 is 1/10, not the float nearest it), so one is
    held out as soon as there is a pair."""
    return math.ceil(pairs * Fraction(str(eval_fraction)))


def held_out_positions(pairs: int, eval_fraction: float) -> list[bool]:
    """Which of ``pairs`` pairs, in the order they arrived, are held out: position g is when one more pair raises
    :func:`held_out_pairs` (with 0.25: the 1st, 5th, 9th, ...). The first N positions are the same whatever follows
    them, so as iterations add pairs the held-out set only grows: a pair once held out is never trained on by a
    later reward model that continues the earlier one, and the held-out accuracy accumulates (issue 43)."""
    return [held_out_pairs(g + 1, eval_fraction) > held_out_pairs(g, eval_fraction) for g in range(pairs)]


def eval_split_error(pairs: int, eval_fraction: float) -> str | None:
    """Why ``pairs`` pairs split by ``eval_fraction`` cannot train a reward model (none held out, or none left to
    train on), or None when they can. Few held-out pairs are not refused: the accuracy rests on ``eval_pairs`` of
    them, said beside it, and grows firmer as later iterations add theirs."""
    held_out = held_out_pairs(pairs, eval_fraction)
    if held_out >= 1 and pairs - held_out >= 1:
        return None
    return (
        f"`reward_model.eval_fraction` {eval_fraction} of {pairs} preference pairs holds out {held_out} and leaves "
        f"{pairs - held_out} to train on: the reward model needs at least one of each; raise the number of pairs, "
        "or lower `reward_model.eval_fraction`"
    )


# The names above are declared here, not beside their code, so that reading a config (the `rlhf` command's start)
# imports no torch.
Estimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"]
"""Advantage estimators (:mod:`rlhf_core.gae`, :mod:`rlhf_core.advantages`). Named here, not beside their
maths, so that a stage importing the config does not import (and fingerprint) the estimators' code."""
GROUP_ESTIMATORS: tuple[Estimator, ...] = ("grpo", "dr_grpo", "rloo")
"""Estimators whose baseline is the other samples of the same prompt: they need groups of at least 2."""
CRITIC_ESTIMATORS: tuple[Estimator, ...] = ("gae",)
"""Estimators that need a value model (a critic)."""
ScoreStatistics = Literal["held_out", "running"]
"""Where the score normalisation's mean and std come from (:class:`AdvantageConfig`)."""
KLPlacement = Literal["reward", "loss"]
"""Where the KL to the reference acts: the shaped reward, or the policy loss."""


def exact_div(numerator: int, denominator: int, *, what: str) -> int:
    """``numerator // denominator``, refusing a remainder with a message naming ``what``."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{what}: {denominator} must divide {numerator}")
    return numerator // denominator


class SettingError(ValueError):
    """A stage setting that cannot be used.

    Attributes:
        field: the setting's field name (``clip_eps``), so a caller can name it in full (``ppo.clip_eps``).
        problem: what is wrong with its value.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"`{field}` {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range of a numeric setting: ``gt``/``lt`` are exclusive limits, ``ge``/``le`` inclusive ones.

    Declared once per field (:func:`bounded`); ``__post_init__`` checks them (:func:`check_fields`) and
    the Prefect form states them as JSON-schema bounds (``flows/serve.py``).
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def contains(self, value: float) -> bool:
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def __str__(self) -> str:
        limits = {">": self.gt, ">=": self.ge, "<": self.lt, "<=": self.le}
        return " and ".join(f"{sign} {limit:g}" for sign, limit in limits.items() if limit is not None)


def bounded(default: Any, **limits: float) -> Any:
    """A dataclass field defaulting to ``default`` whose value (unless None) must lie within ``Bounds(**limits)``."""
    return field(default=default, metadata={"bounds": Bounds(**limits)})


def field_bounds(config_class: type) -> dict[str, Bounds]:
    """``field name -> Bounds`` of every bounded field of a stage config class."""
    return {f.name: f.metadata["bounds"] for f in fields(config_class) if "bounds" in f.metadata}


def _check_choice(name: str, value: str, choices: Any) -> None:
    """Refuse ``value`` unless it is one of the ``Literal`` type ``choices``."""
    if value not in get_args(choices):
        raise SettingError(name, f"must be one of {get_args(choices)}, got {value!r}")


def check_fields(config: Any) -> None:
    """Refuse a NaN or infinite number in any field of ``config``, and a value outside its field's bounds.

    Raises:
        SettingError: naming the field, its range and the value.
    """
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            raise SettingError(f.name, f"must be a finite number, got {value}")
        bounds = f.metadata.get("bounds")
        if bounds is not None and not bounds.contains(value):
            raise SettingError(f.name, f"must be {bounds}, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingConfig:
    """How responses are sampled (stages: sample candidates, rollout, evaluate)."""

    max_new_tokens: int = bounded(256, gt=0)
    """Longest response, in tokens; longer ones are truncated (and scored at their last token). Between TRL's PPO
    default (53) and OpenRLHF's (1024): room for a chat answer."""
    temperature: float = bounded(1.0, gt=0)
    """Softmax temperature; log-probs use the same one (TRL, OpenRLHF)."""
    top_k: int = bounded(0, ge=0)
    """Keep only the k most likely tokens; 0 keeps all (pure sampling, as PPO theory assumes)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 keeps all."""
    batch_size: int = bounded(64, gt=0)
    """Prompts generated together (each with all its samples)."""
    engine: GenerationEngine = "hf"
    """What samples: `hf` (the project's own KV-cache loop on the stage's models) or `vllm` (a long-lived vLLM
    engine in its own environment, `bash scripts/setup-vllm.sh`; see docs/engines.md). Other engines pick other
    tokens for the same seed, so it is part of the generation stages' input keys."""
    staleness: int = bounded(0, ge=0)
    """Policy versions the generation stages may lag behind the update (:mod:`rlhf_core.off_policy`): 0 samples each
    iteration from the policy the previous update made (sequential iterations); 1 samples iteration k+1 from the policy
    that sampled iteration k, so a campaign samples it while iteration k's update runs (verl's one-step-off, NeMo-RL's
    `max_trajectory_age_steps` 1, prime-rl's `max_async_level` 1); N samples N versions behind. It changes what is
    sampled, so it is part of the generation stages' keys. 0 until overlap is measured faster (bench/RESULTS.md)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_choice("engine", self.engine, GenerationEngine)

    @property
    def of_a_given_policy(self) -> SamplingConfig:
        """These settings for a stage that samples the policy it is given (the reference, the evaluated policy):
        ``staleness`` chooses which policy a generation stage samples, and changes nothing of how a given one is
        sampled, so those stages get it at 0 and their keys do not change with it (issue 42)."""
        return replace(self, staleness=0)

    @property
    def kept_as_sampled(self) -> SamplingConfig:
        """These settings for a stage that keeps the sampled tokens and computes nothing of them (the reference's
        samples): on the engine a stage asks for a whole shard in one request (:class:`tasks.sampler.WholeShards`),
        so ``batch_size`` only chooses how it reads the answers back and is left at its default, out of the key
        (issue 42); the ``hf`` sampler samples batch by batch, so there it stays. Every other sampling stage also
        runs the trainer's model over its rows in batches of ``batch_size`` (the candidates' and the rollout's
        log-probs, evaluation's scores), whose padded width can move the last bits of a sum: keyed there."""
        if self.engine == "hf":
            return self
        return replace(self, batch_size=SamplingConfig.__dataclass_fields__["batch_size"].default)


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardModelConfig:
    """Reward-model training over preference pairs (stage: train reward model)."""

    learning_rate: float = bounded(9e-6, gt=0)
    """AdamW learning rate (OpenRLHF's reward-model default, for full fine-tuning of a pretrained backbone)."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    epochs: int = bounded(1, gt=0)
    """Passes over the training pairs (OpenRLHF 1: a reward model overfits its pairs quickly)."""
    batch_size: int = bounded(32, gt=0)
    """Pairs per optimizer step."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient-norm clip."""
    eval_fraction: float = bounded(0.1, gt=0, lt=1)
    """Share of pairs held out for accuracy."""
    use_margin: bool = True
    """Subtract each pair's margin in the Bradley-Terry loss (Llama 2)."""
    train: bool = True
    """Train the reward model on the collected pairs. False uses a pretrained one as it is (no pairs are
    collected): only with a pretrained reward model."""
    replay_ratio: float | None = bounded(None, ge=0)
    """What each iteration's reward model, continuing the previous one, trains on: None (the default) every
    training pair so far; a ratio r, the iteration's new training pairs and r times as many older ones drawn
    again (a replay, as continual learning keeps old data in view), so its cost stays that of an iteration's
    pairs (issue 43; :func:`rlhf_core.reward_training.replayed_rows`)."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvantageConfig:
    """Rewards, KL and advantages (stage: compute advantages). Pure: replaying with new values is cheap."""

    estimator: Estimator = "gae"
    """Advantage estimator: gae (with a critic), or critic-free grpo, dr_grpo, rloo (groups of samples of a
    prompt, `sizes.samples_per_prompt` >= 2) or reinforce_pp (see rlhf_core.advantages)."""
    kl_coef: float = bounded(0.05, ge=0)
    """KL penalty weight beta in the reward (TRL default 0.05). With `kl_target` it is only where the adaptive
    controller starts: later iterations, and replays, start from the coefficient the previous stage-5 output
    handed on, so changing it mid-campaign has no effect."""
    kl_estimator: KLEstimator = "k1"
    """Per-token KL estimator in the reward: k1, k2 or k3."""
    kl_in: KLPlacement = "reward"
    """Where the KL to the reference acts: `reward` (shaped per-token reward, weight `kl_coef`) or `loss` (k3 term
    in the policy loss, weight `ppo.kl_loss_coef`, GRPO style)."""
    kl_target: float | None = bounded(None, gt=0)
    """Turns on the adaptive KL controller (Ziegler et al. 2019): `kl_coef` moves to hold the rollouts' KL to the
    reference (nats per response) near this. None keeps `kl_coef` fixed."""
    kl_horizon: int = bounded(10000, gt=0)
    """Rollouts the adaptive controller takes to correct by its clipped error (Ziegler et al. 2019; TRL 10000)."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount of GAE and REINFORCE++ (TRL and OpenRLHF use 1.0 for language); the group estimators use 1."""
    gae_lambda: float = bounded(0.95, ge=0, le=1)
    """GAE lambda (TRL default 0.95); GAE only."""
    score_clip: float | None = bounded(None, gt=0)
    """Clip scores to [-score_clip, score_clip] before shaping."""
    normalize_scores: bool = True
    """Standardise reward-model scores (a reward function's scores are used as they are), with the mean and std
    `score_statistics` names."""
    score_statistics: ScoreStatistics = "held_out"
    """Where the mean and std that normalise reward-model scores come from: `held_out`, the reward model's scores of
    its held-out pairs (OpenRLHF's `normalize_reward`), or `running`, every rollout's scores so far, this one's
    included (TRL's `use_score_scaling`), carried from iteration to iteration by this stage's output."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_choice("estimator", self.estimator, Estimator)
        _check_choice("kl_estimator", self.kl_estimator, KLEstimator)
        _check_choice("kl_in", self.kl_in, KLPlacement)
        _check_choice("score_statistics", self.score_statistics, ScoreStatistics)
        if self.kl_target is not None and self.kl_in != "reward":
            raise SettingError("kl_target", "adapts the KL coefficient of the reward: it needs `kl_in` = 'reward'")
        if self.kl_target is not None and self.kl_coef == 0:
            raise SettingError(
                "kl_coef", "is where the adaptive controller (`kl_target`) starts, and it scales it: > 0"
            )

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

    epochs: int = bounded(4, gt=0)
    """Passes over the experience (TRL ``num_ppo_epochs`` 4)."""
    minibatch_size: int = bounded(16, gt=0)
    """Rollouts per optimizer step."""
    actor_learning_rate: float = bounded(1e-6, gt=0)
    """Actor AdamW learning rate (OpenRLHF 1e-6; TRL 3e-6)."""
    critic_learning_rate: float = bounded(9e-6, gt=0)
    """Critic AdamW learning rate (OpenRLHF 9e-6: the fresh value head needs more than the actor)."""
    clip_eps: float = bounded(0.2, gt=0)
    """Policy ratio clip epsilon (Schulman et al. 2017)."""
    dual_clip: float | None = bounded(None, gt=1)
    """Dual-clip constant c > 1 (Ye et al. 2020), or None."""
    value_clip_eps: float | None = bounded(0.2, gt=0)
    """Value clip around rollout values, or None."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Entropy bonus weight."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient-norm clip for each model."""
    target_kl: float | None = bounded(None, gt=0)
    """Stop the update early once the running approximate KL exceeds this."""
    kl_budget: float | None = bounded(None, gt=0)
    """The policy's KL to the reference (nats per response, as `evaluate/kl_to_reference` measures it) the update
    stops at: before each step the current policy's is estimated on the minibatch's rollout tokens, and past this the
    update takes no more steps (none where the policy starts past it: it stays as it was). It may pass it by what one
    step moves it. None: no budget (the KL in the reward, `advantages.kl_coef`, pulls back, but holds no bound)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the whole experience before minibatching (critic-free estimators normalise their
    own, see rlhf_core.advantages)."""
    aggregation: LossAggregation = "token_mean"
    """Token-level loss aggregation: token_mean, sequence_mean, or token_sum_norm (each response's token sum over
    the generation budget `sampling.max_new_tokens`, as Dr. GRPO)."""
    kl_loss_coef: float = bounded(0.0, ge=0)
    """Weight of the k3 KL to the reference in the policy loss (GRPO's beta; DeepSeekMath 0.04); needs
    `advantages.kl_in` = loss."""
    tis_cap: float | None = bounded(None, gt=0)
    """Truncated importance sampling of the engine's mismatch (Yao et al. 2025, "TIS"): each token's policy loss
    is weighted by min(exp(old_logprobs - engine_logprobs), tis_cap), the probability the trainer gives the
    sampled token over the one the sampler gave it, capped. None weighs every token 1 (verl and SkyRL use 2)."""
    off_policy: OffPolicyCorrection = "decoupled"
    """The correction for rows an older policy sampled (`sampling.staleness` >= 1; on-policy rows need none):
    `decoupled` (Hilton et al. 2022; AReaL, NeMo-RL) clips the ratio around the policy the update starts from and
    weighs each token by min(pi_prox / pi_behaviour, `behaviour_weight_cap`); `behaviour` takes the sampling policy's
    log-probs as pi_old (verl's one-step-off, TRL's async GRPO, prime-rl): no recomputation, but the clip region is
    around a policy the update has already left (rlhf_core.off_policy)."""
    behaviour_weight_cap: float = bounded(2.0, gt=0)
    """The truncation of decoupled PPO's behaviour weight pi_prox / pi_behaviour (truncated importance sampling as
    IMPALA's and TIS's; 2 as verl's and SkyRL's TIS caps)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_choice("aggregation", self.aggregation, LossAggregation)
        _check_choice("off_policy", self.off_policy, OffPolicyCorrection)


@dataclass(frozen=True, slots=True, kw_only=True)
class DPOConfig:
    """The direct preference update of the actor on the iteration's pairs (stage: dpo update; ``update: dpo``).

    Defaults are TRL's ``DPOConfig`` (``beta``, ``loss_type``, ``label_smoothing``, ``learning_rate``; ``epochs``,
    ``batch_size`` and ``max_grad_norm`` from the ``TrainingArguments`` it extends) and TRL's ``CPOConfig`` for
    ``simpo_gamma``.
    """

    beta: float = bounded(0.1, gt=0)
    """The strength of the KL regularisation to the reference (DPO's beta; IPO's tau; SimPO's reward scale)."""
    loss: PreferenceLoss = "sigmoid"
    """`sigmoid` (DPO, Rafailov et al. 2023), `ipo` (Azar et al. 2023) or `simpo` (Meng et al. 2024; reference-free)."""
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    """cDPO's assumed probability that a label is flipped; the `sigmoid` loss only (0: plain DPO)."""
    simpo_gamma: float = bounded(0.5, ge=0)
    """SimPO's target reward margin, read by loss `simpo` only (TRL `CPOConfig.simpo_gamma` 0.5)."""
    epochs: int = bounded(3, gt=0)
    """Passes over the iteration's pairs (TRL `num_train_epochs` 3)."""
    batch_size: int = bounded(8, gt=0)
    """Pairs per optimizer step (TRL `per_device_train_batch_size` 8)."""
    learning_rate: float = bounded(1e-6, gt=0)
    """Actor AdamW learning rate (TRL `DPOConfig.learning_rate` 1e-6)."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient-norm clip (TRL 1.0)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_choice("loss", self.loss, PreferenceLoss)
        if self.label_smoothing and self.loss != "sigmoid":
            raise SettingError(
                "label_smoothing",
                f"is the sigmoid loss's (cDPO) only, got {self.label_smoothing} with loss {self.loss}",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class SFTConfig:
    """Supervised fine-tuning of the initial policy on demonstrations (stage: sft; ``sft.data``).

    Defaults are TRL's ``SFTConfig`` (``learning_rate`` 2e-5; ``epochs``, ``batch_size`` and ``max_grad_norm`` from
    the ``TrainingArguments`` it extends; AdamW without weight decay, as ``TrainingArguments.weight_decay`` 0).
    """

    epochs: int = bounded(3, gt=0)
    """Passes over the examples (TRL `num_train_epochs` 3)."""
    batch_size: int = bounded(8, gt=0)
    """Examples per optimizer step (TRL `per_device_train_batch_size` 8); the loss is the mean over the assistant
    tokens of the whole batch."""
    learning_rate: float = bounded(2e-5, gt=0)
    """AdamW learning rate (TRL `SFTConfig.learning_rate` 2e-5)."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient-norm clip (TRL 1.0)."""
    packing: bool = False
    """Pack each minibatch's examples several to a row, each attending only to itself (TRL `packing` with whole
    examples, its "bfd" strategy): the same examples, steps and loss as unpacked, less padding
    (:mod:`rlhf_core.sft`, choice 6)."""
    packed_length: int | None = bounded(None, gt=0)
    """The longest packed row, in tokens (TRL `max_length` when packing); None: the longest example, so no row is
    longer than the longest unpacked one. Never splits an example; read only with ``packing``."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.packed_length is not None and not self.packing:
            raise SettingError("packed_length", "is read only with `packing`: set `packing` true, or drop it")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021) on every trained model, through peft (stages: initialize, train reward model).

    The base weights stay frozen (in the precision's dtype) and are never saved again: a stage output
    holds the adapters (and heads). The reference policy is the actor with its adapters switched off.
    """

    r: int = bounded(8, gt=0)
    """Adapter rank (peft's default)."""
    alpha: int = bounded(16, gt=0)
    """Scaling numerator: updates are scaled by alpha / r (2 at the defaults, as TRL's PPO examples)."""
    dropout: float = bounded(0.05, ge=0, lt=1)
    """Dropout on the adapter input during reward-model training (off in the PPO update, as all dropout)."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """Modules that get adapters: peft's ``all-linear`` (every linear layer but the output layer) or names."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.target_modules:
            raise SettingError("target_modules", "must name at least one module, or be 'all-linear'")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sharding:
    """How the trained models are sharded over the processes: FSDP2 (``fully_shard``), full shard.

    Every module of a transformer layer class is one FSDP unit (its parameters gathered for its forward and
    backward only), and the model's remaining parameters (embeddings, final norm, heads) form the root unit.
    """

    layer_classes: tuple[str, ...] = ()
    """Class names of the layers to shard one by one; empty: the model's own ``_no_split_modules`` (what
    accelerate's ``TRANSFORMER_BASED_WRAP`` uses)."""
    reshard_after_forward: bool = True
    """Free a layer's gathered parameters after its forward (full shard, ZeRO-3); False keeps them until the
    backward (ZeRO-2's memory for less communication)."""
