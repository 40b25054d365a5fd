"""What each stage is given: one frozen dataclass per stage, its settings (by config path) and its inputs
(other stages' outputs), declared once (:mod:`runtime.declaration`).

Each stage's module declares the stage itself (``rollout = Stage(RolloutSettings, plan=..., work=...)``); its
settings live here, in one module that imports neither torch nor Prefect, because the campaign model derives the
settings table and the replay rules from them (:mod:`campaign.settings`) in commands that load no model library.
Adding a setting to a stage is one field here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.declaration import StageSettings, setting, upstream

if TYPE_CHECKING:
    from rlhf_core.config import (
        AdvantageConfig,
        DPOConfig,
        LabelerName,
        LoraConfig,
        Pairing,
        PPOConfig,
        RewardModelConfig,
        SamplingConfig,
        SFTConfig,
    )
    from rlhf_core.precision import Precision
    from runtime.context import InputFile
    from runtime.declaration import StageResult
    from runtime.references import EnvironmentReference, JudgeReference, RewardFunctionReference


@dataclass(frozen=True)
class SFTSettings(StageSettings):
    """Before iteration 0 (``sft.data``): the pretrained policy fine-tuned on demonstrations, the campaign's initial
    policy and reference."""

    stage = "sft"
    sft: SFTConfig = setting("sft.training")
    data: InputFile = setting("base.sft_data")
    """The demonstrations (by content)."""
    precision: Precision = setting("precision")
    lora: LoraConfig | None = setting("model.lora")
    """Train adapters (merged into the output's weights) or, None, every weight."""
    rows_per_shard: int = setting("sizes.rows_per_shard")


@dataclass(frozen=True)
class InitializeSettings(StageSettings):
    """Stage 0: the campaign's starting actor (and critic)."""

    stage = "initialize"
    sft: StageResult | None = upstream()
    """The SFT output the actor is (the base policy then: :meth:`runtime.context.BaseInputs.supervised`), or None;
    named here so that the lineage shows it under every policy."""
    critic: bool = setting("has_critic")
    """Make a critic (an estimator that uses one: GAE; never for a DPO update)."""
    lora: LoraConfig | None = setting("model.lora")
    critic_init: str = setting("model.critic_init")
    """``policy`` or ``reward_model``: the base the critic starts from."""


@dataclass(frozen=True)
class SampleCandidatesSettings(StageSettings):
    """Stage 1: N responses per preference prompt from the current actor."""

    stage = "sample_candidates"
    policy: StageResult = upstream()
    earlier: tuple[StageResult, ...] = upstream()
    """The candidates of this iteration's earlier rounds (``sizes.decisive_pairs``): this round samples the prompts of
    the rotation after theirs. Empty in the first round, the only one without ``sizes.decisive_pairs``."""
    sampling: SamplingConfig = setting("sampling")
    precision: Precision = setting("precision")
    prompts: int = setting("sizes.preference_prompts")
    candidates_per_prompt: int = setting("sizes.candidates_per_prompt")
    rows_per_shard: int = setting("sizes.rows_per_shard")


@dataclass(frozen=True)
class HumanLabelsSettings(StageSettings):
    """A person's answers for the candidate pairs (labeler ``human``; asked by the flow, :mod:`flows.human_labels`)."""

    stage = "human_labels"
    module = "flows.human_labels"  # asking pauses the flow run: a flow-level step
    candidates: StageResult = upstream()
    reward_model: StageResult | None = upstream()
    """The previous iteration's reward model, whose margins choose the pairs asked about with ``asking.select``
    uncertain; None otherwise (and in the first iteration: drawn at random)."""
    asking: Any = setting("asking")
    """Which of the candidate pairs the person is asked about (:class:`campaign.config.AskingConfig`)."""
    eval_fraction: float = setting("reward_model.eval_fraction")
    """The share of the asked pairs drawn at random to be held out, with ``asking.select`` other than all."""
    precision: Precision | None = setting("labeling_precision")
    """The precision the reward model scores the candidates in, with ``asking.select`` uncertain."""
    relabel: int = setting("human.relabel")
    """Answers are stored per value: another value asks again."""
    human: Any = setting("human", keyed=False)
    """How the forms are shown and waited for (:class:`campaign.config.HumanLabelConfig`)."""


@dataclass(frozen=True)
class CollectPreferencesSettings(StageSettings):
    """Stage 2: preference labels for the candidate pairs (or pairs imported from a file)."""

    stage = "collect_preferences"
    candidates: StageResult | None = upstream()
    """The candidates to label; None with labeler ``import``, which samples none."""
    reward_model: StageResult | None = upstream()
    """The previous iteration's reward model: the judge with labeler ``reward_model`` (None in the first iteration,
    where the pretrained ``model.reward_model`` judges), and whose margins choose the pairs asked about with
    ``asking.select`` uncertain (None in the first iteration: drawn at random); None otherwise."""
    labels: StageResult | None = upstream()
    """The person's answers (a ``human_labels`` output) with labeler ``human``; None otherwise."""
    earlier: tuple[StageResult, ...] = upstream()
    """The preferences of this iteration's earlier rounds (``sizes.decisive_pairs``): this round's pair ids follow
    theirs. Empty in the first round."""
    labeler: LabelerName = setting("labeler")
    pairing: Pairing = setting("pairing")
    """Which pairs of a prompt's candidates are compared and kept (:mod:`tasks.pairing`)."""
    asking: Any = setting("asking")
    """Which of the compared pairs the labeler is asked about (:class:`campaign.config.AskingConfig`)."""
    eval_fraction: float = setting("reward_model.eval_fraction")
    """The share of the asked pairs drawn at random to be held out, with ``asking.select`` other than all."""
    judge: JudgeReference | None = setting("base.judge")
    rubric: RewardFunctionReference | None = setting("base.rubric")
    preferences: InputFile | None = setting("base.preferences")
    precision: Precision | None = setting("labeling_precision")
    """The precision the reward model judges in (labeler ``reward_model``); None for a labeler that loads no model."""
    rows_per_shard: int = setting("sizes.rows_per_shard")


@dataclass(frozen=True)
class TrainRewardModelSettings(StageSettings):
    """Stage 3: the reward model, trained on every preference pair so far."""

    stage = "train_reward_model"
    preferences: tuple[StageResult, ...] = upstream()
    previous: StageResult | None = upstream()
    """The previous iteration's reward model, which training continues; None in the first iteration."""
    reward_model: RewardModelConfig = setting("reward_model")
    precision: Precision = setting("precision")
    lora: LoraConfig | None = setting("model.lora")


@dataclass(frozen=True)
class RolloutSettings(StageSettings):
    """Stage 4: scored rollouts of the actor."""

    stage = "rollout"
    policy: StageResult = upstream()
    reward_model: StageResult | None = upstream()
    """The reward model, or None when ``reward_function`` scores instead."""
    critic_start: StageResult | None = upstream()
    """Where the critic starts when the policy has none yet: the first trained reward model (``model.critic_init``
    reward_model without a pretrained one; :mod:`tasks.initialize`), while the policy sampled is the campaign's
    initial one; None otherwise."""
    sampling: SamplingConfig = setting("sampling")
    precision: Precision = setting("precision")
    prompts: int = setting("sizes.rollout_prompts")
    samples_per_prompt: int = setting("sizes.samples_per_prompt")
    rows_per_shard: int = setting("sizes.rows_per_shard")
    reward_function: RewardFunctionReference | None = setting("base.reward_function")
    environment: EnvironmentReference | None = setting("base.environment")
    """The environment of multi-turn episodes, or None: one response per prompt (:mod:`tasks.episodes`)."""
    max_turns: int = setting("environment.max_turns")
    """The most model turns of an episode (the episodes' limits: :class:`campaign.config.EnvironmentSource`)."""
    max_tokens_per_turn: int = setting("environment.max_tokens_per_turn")
    step_timeout_s: float = setting("environment.step_timeout_s")


@dataclass(frozen=True)
class CriticValuesSettings(StageSettings):
    """Before stage 5 of an overlapped iteration (``sampling.staleness``), where the rollout's values came from an older
    policy's critic: the values of the critic the update starts from, for the rollout's rows."""

    stage = "critic_values"
    experience: StageResult = upstream()
    """The rollout whose rows are valued."""
    policy: StageResult = upstream()
    """The policy the update starts from: its critic values the rows."""
    critic_start: StageResult | None = upstream()
    """Where that critic starts when the policy has none yet (as :attr:`PPOUpdateSettings.critic_start`)."""
    precision: Precision = setting("precision")
    batch_size: int = setting("sampling.batch_size")
    """Rows per forward pass of the critic (keyed: a batch's padded width can move the last bits of a value)."""
    rows_per_shard: int = setting("sizes.rows_per_shard")


@dataclass(frozen=True)
class ComputeAdvantagesSettings(StageSettings):
    """Stage 5: per-token rewards, KL, advantages and returns (pure)."""

    stage = "compute_advantages"
    experience: StageResult = upstream()
    critic_values: StageResult | None = upstream()
    """The values of the critic the update starts from, where the rollout's came from another (a ``critic_values``
    output: an overlapped iteration's), which stand in for the experience's; None: the experience's own."""
    reward_model: StageResult | None = upstream()
    """The reward model whose held-out score statistics normalise the scores, or None for a reward function's
    scores (used as they are)."""
    previous: StageResult | None = upstream()
    """The previous iteration's output of this stage (None in the first): where the adaptive KL coefficient and the
    running score moments come from."""
    advantages: AdvantageConfig = setting("advantages")
    reward_model_retrained: bool = setting("reward_model.train")
    """Whether each iteration retrains the reward model (running score moments then start again with each)."""
    rows_per_shard: int = setting("sizes.rows_per_shard")


@dataclass(frozen=True)
class OptimizerState:
    """The optimizer states a policy output was written with, identified by their content.

    Args:
        path: the policy output folder holding them.
        digest: their identity (kept in the manifest, also once they are pruned).
        present: whether the files are still on disk.
    """

    path: str
    digest: str
    present: bool


def critic_folder(policy: Path, critic_start: StageResult | None) -> Path:
    """The critic of the policy output (or mid-stage checkpoint) folder ``policy``, or, where it has none yet, the
    reward model it starts from (``critic_start``: :attr:`RolloutSettings.critic_start`)."""
    if (policy / "critic").is_dir() or critic_start is None:
        return policy / "critic"
    return critic_start.directory / "reward_model"


def critic_score_statistics(policy: Path, critic_start: StageResult | None) -> tuple[float, float] | None:
    """The mean and std folded into the head of a critic that starts from the reward model ``critic_start`` (where
    :func:`critic_folder` is that reward model): its held-out score statistics, which normalise the scores whose
    returns the critic learns (:func:`rlhf_core.rewards.fold_normalisation`; such a campaign normalises its scores:
    :class:`campaign.config.PipelineConfig` refuses one that does not); None for a policy's own critic. With
    ``advantages.score_statistics`` running they stand in for the running moments, which the rollout does not know
    yet."""
    if critic_folder(policy, critic_start) == policy / "critic":
        return None
    assert critic_start is not None  # critic_folder is the reward model's
    return critic_start.metrics["score_mean"], critic_start.metrics["score_std"]


@dataclass(frozen=True)
class PPOUpdateSettings(StageSettings):
    """Stage 6: new actor (and critic) checkpoints from the scored experience."""

    stage = "ppo_update"
    policy: StageResult = upstream()
    optimizer: OptimizerState | None = upstream()
    """The optimizer states of ``policy`` to continue (:func:`tasks.ppo_update.optimizer_state`); None starts
    fresh ones."""
    scored: StageResult = upstream()
    critic_start: StageResult | None = upstream()
    """Where the critic starts when the policy has none yet (as the rollout's :attr:`RolloutSettings.critic_start`)."""
    ppo: PPOConfig = setting("ppo")
    critic: bool = setting("advantages.uses_critic")
    """Train the policy's critic (GAE), or update the actor alone (critic-free estimators)."""
    precision: Precision = setting("precision")
    temperature: float = setting("sampling.temperature")
    """The sampling temperature of the rollout (the update's log-probs use it too)."""
    max_new_tokens: int = setting("sampling.max_new_tokens")
    """The generation budget, the constant of the ``token_sum_norm`` aggregation."""
    staleness: int = setting("sampling.staleness")
    """How many policy versions behind the update its rows may be (:mod:`tasks.staleness`)."""


@dataclass(frozen=True)
class ReferenceLogprobsSettings(StageSettings):
    """Stage 3 of a DPO iteration: the reference's log-probs of the iteration's decisive pairs, in the policy's
    tokens, which the DPO update and every replay of it read back instead of running the reference."""

    stage = "reference_logprobs"
    preferences: tuple[StageResult, ...] = upstream()
    """The preference tables whose pairs the update trains on (the iteration's)."""
    precision: Precision = setting("precision")
    batch_size: int = setting("sampling.batch_size")
    """Pairs per forward pass of the reference (keyed: a batch's padded width can move the last bits of a sum)."""
    rows_per_shard: int = setting("sizes.rows_per_shard")


@dataclass(frozen=True)
class DPOUpdateSettings(StageSettings):
    """Stage 4 of a DPO iteration: the new actor, trained on the pairs against the reference's stored log-probs."""

    stage = "dpo_update"
    policy: StageResult = upstream()
    pairs: StageResult = upstream()
    """The pairs and their reference log-probs (a ``reference_logprobs`` output)."""
    dpo: DPOConfig = setting("dpo")
    precision: Precision = setting("precision")


@dataclass(frozen=True)
class SampleReferenceSettings(StageSettings):
    """Once per campaign: the reference's responses to the held-out prompts, which every evaluation reads back."""

    stage = "sample_reference"
    sampling: SamplingConfig = setting("sampling.of_a_given_policy.kept_as_sampled")
    precision: Precision = setting("precision")
    eval_prompts: InputFile = setting("base.eval_prompts")
    """The held-out prompts file (by content: no other stage's key holds it)."""
    prompts: int = setting("sizes.eval_prompts")
    rows_per_shard: int = setting("sizes.rows_per_shard")
    environment: EnvironmentReference | None = setting("base.environment")
    """The environment the reference plays held-out episodes with, or None: one response per prompt
    (:mod:`tasks.episode_evaluation`)."""
    max_turns: int = setting("environment.max_turns")
    max_tokens_per_turn: int = setting("environment.max_tokens_per_turn")
    step_timeout_s: float = setting("environment.step_timeout_s")


@dataclass(frozen=True)
class EvaluateSettings(StageSettings):
    """Stage 7: the policy against the reference on held-out prompts."""

    stage = "evaluate"
    policy: StageResult = upstream()
    reference: StageResult = upstream()
    """The reference's responses to the same prompts, with the same seeds (a ``sample_reference`` output)."""
    reward_model: StageResult | None = upstream()
    """The reward model, or None when ``reward_function`` scores instead."""
    sampling: SamplingConfig = setting("sampling.of_a_given_policy")
    precision: Precision = setting("precision")
    eval_prompts: InputFile = setting("base.eval_prompts")
    """The held-out prompts file (by content: no other stage's key holds it)."""
    prompts: int = setting("sizes.eval_prompts")
    """How many held-out prompts to evaluate (the first ones of the file)."""
    judge: JudgeReference | None = setting("base.judge")
    """The gold judge, or None for no gold metrics."""
    rubric: RewardFunctionReference | None = setting("base.rubric")
    """The rubric that labels pairs (labeler ``function``): its mean score of both sides is reported beside the
    reward's; None for none."""
    reward_function: RewardFunctionReference | None = setting("base.reward_function")
    rewarded: bool = setting("rewarded")
    """Whether the campaign has a reward (``reward_model``, ``reward_function`` or ``environment``): a DPO update's has
    none."""
    rows_per_shard: int = setting("sizes.rows_per_shard")
    environment: EnvironmentReference | None = setting("base.environment")
    """The environment the policy plays held-out episodes with (its reward), or None: one response per prompt
    (:mod:`tasks.episode_evaluation`)."""
    max_turns: int = setting("environment.max_turns")
    max_tokens_per_turn: int = setting("environment.max_tokens_per_turn")
    step_timeout_s: float = setting("environment.step_timeout_s")


STAGES: tuple[type[StageSettings], ...] = (
    SFTSettings,
    InitializeSettings,
    SampleCandidatesSettings,
    HumanLabelsSettings,
    CollectPreferencesSettings,
    TrainRewardModelSettings,
    RolloutSettings,
    CriticValuesSettings,
    ComputeAdvantagesSettings,
    PPOUpdateSettings,
    ReferenceLogprobsSettings,
    DPOUpdateSettings,
    SampleReferenceSettings,
    EvaluateSettings,
)
"""Every stage's settings, in the order of an iteration."""
