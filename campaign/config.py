"""PipelineConfig: the one validated parameter of every flow (Prefect renders it as a form).

It composes the frozen stage configs of :mod:`rlhf_core.config` plus what the pipeline adds:
where models and data come from, the labeler, sizes per iteration, where outputs go. YAML files
in ``configs/`` are diffs from these defaults; ``--set a.b=value`` overrides apply on top.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import logging
import textwrap
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlhf_core.config import (
    GROUP_ESTIMATORS,
    MIN_PREFERENCE_PAIRS,
    SCORING_LABELERS,
    AdvantageConfig,
    DPOConfig,
    LabelerName,
    LoraConfig,
    Pairing,
    PPOConfig,
    Precision,
    RewardModelConfig,
    SamplingConfig,
    SettingError,
    SFTConfig,
    UpdateName,
    eval_split_error,
)
from rlhf_core.errors import UserError
from runtime.execution import ExecutionConfig
from runtime.execution import Settings as _Frozen

logger = logging.getLogger(__name__)


class ModelSource(_Frozen):
    """Where the initial policy comes from."""

    policy: str | None = None
    """A Hugging Face causal-LM folder (or a hub name, if the machine can reach the hub). Needed unless `demo` is
    true, where None builds and uses the embedded demo model."""
    tokenizer: str | None = None
    """Tokenizer folder or name; None uses the policy's."""
    reward_model: str | None = None
    """A pretrained reward model: a folder this project saved (`reward_model/` of a stage output, or an export), or
    any `AutoModelForSequenceClassification` checkpoint with one label. Its own tokenizer scores the conversations.
    `reward_model.train` false uses it as it is; true fine-tunes it on the collected pairs. None: a reward model
    is trained from the policy."""
    critic_init: Literal["policy", "reward_model"] = "policy"
    """What the critic starts from: the policy's backbone with a fresh value head, or a reward model (its backbone,
    and its score head as the value head; as OpenRLHF and verl do): the pretrained `model.reward_model`, or, without
    one, the first reward model the campaign trains (iteration 0's rollout and update take it as the critic)."""
    lora: LoraConfig | None = None
    """Low-rank adapters on every trained model (actor, critic, reward model); `--set model.lora.r=8` alone turns
    them on with the other defaults. None trains every weight."""


class DataSource(_Frozen):
    """Where prompts and imported preferences come from."""

    prompts: Path | None = None
    """Training prompts (JSONL, Parquet, CSV or a datasets folder with a `prompt` column or chat `messages`). Needed
    unless `demo` is true, where None uses the demo's."""
    eval_prompts: Path | None = None
    """Held-out prompts for evaluation, in the same forms. Needed unless `demo` is true, where None uses the demo's."""
    preferences: Path | None = None
    """Preference pairs to import (labeler `import`): prompt/chosen/rejected rows or Anthropic HH transcripts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSection(SFTConfig):
    """Supervised fine-tuning before iteration 0 (the `sft` stage, docs/recipes.md): with `data`, the initial policy is
    `model.policy` trained on those demonstrations, and the campaign's reference is that policy too. The training
    settings are TRL's `SFTConfig` defaults; LoRA or full and the processes follow `model.lora` and `execution`."""

    data: Path | None = None
    """Demonstrations (JSONL or Parquet, or a datasets folder): `messages` conversations (the loss on the assistant's
    turns) or `prompt`/`completion` rows (the loss on the completion and EOS). None: no SFT stage."""

    @property
    def training(self) -> SFTConfig:
        """The training settings alone (what the stage's key holds: the data is keyed by its content)."""
        return SFTConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SFTConfig)})


class IterationSizes(_Frozen):
    """How much work one iteration does."""

    preference_prompts: int = Field(256, gt=0)
    """Prompts whose candidates are labelled each iteration."""
    candidates_per_prompt: int = Field(4, ge=2, multiple_of=2)
    """Candidates sampled per preference prompt (an even number); `pairing` says which pairs of them are labelled."""
    rollout_prompts: int = Field(256, gt=0)
    """Prompts rolled out for PPO each iteration."""
    samples_per_prompt: int = Field(1, gt=0)
    """Responses sampled for each rollout prompt (the group size G): rollouts per iteration = rollout_prompts * G.
    The group estimators (grpo, dr_grpo, rloo) need at least 2."""
    eval_prompts: int = Field(64, gt=0)
    """Held-out prompts evaluated each iteration."""
    decisive_pairs: int | None = Field(None, gt=0)
    """Decisive preference pairs (a winner, margin > 0) an iteration wants: while its labelled candidates give fewer,
    it samples and labels another round of `preference_prompts` fresh prompts (the next of the rotation), up to
    `max_rounds` rounds (docs/real-model.md, "A sparse task"). None: one round, as before."""
    max_rounds: int = Field(4, ge=1)
    """The most rounds of candidates an iteration samples to reach `decisive_pairs` (its sampling budget: at most
    `max_rounds` x `preference_prompts` x `candidates_per_prompt` candidates); ending short is said, not refused."""
    rows_per_shard: int = Field(4096, gt=0)
    """Rows per Parquet shard, and per unit of work the generation stages fan out (`execution.task_runner`). Each
    shard samples from its own seed, so changing it changes the outputs: it is part of a campaign's config."""


class HumanLabelConfig(_Frozen):
    """How a person labels candidate pairs (labeler `human`): on the waiting run's labelling page, or in the
    Prefect UI's Resume form."""

    timeout_seconds: int = Field(3600, gt=0)
    """How long each form waits for an answer; then the flow run fails (Prefect's default pause timeout)."""
    poll_seconds: int = Field(10, gt=0)
    """How often the paused run checks whether the form was answered (Prefect's default poll interval)."""
    pairs_per_form: int = Field(16, gt=0)
    """Pairs shown on one form; an iteration's pairs are asked over as many forms as needed, one after another."""
    relabel: int = Field(0, ge=0)
    """Answers are stored per value: raise it to be asked again for candidates that were already labelled."""
    page_host: str = "127.0.0.1"
    """Where the waiting run serves its labelling page (the pairs side by side, one click each; the Prefect UI's
    Resume form works too). Anyone who reaches it can answer: keep 127.0.0.1 unless you trust the network."""
    page_port: int = Field(0, ge=0, le=65535)
    """The labelling page's port; 0 takes any free one. The run's log and its Resume form give the address."""


class AskingConfig(_Frozen):
    """Which of an iteration's compared candidate pairs the labeler is asked about (:func:`tasks.pairing.asked_pairs`):
    all of them, or a budget of `pairs` a round, for a labeler that costs (a person: docs/human-labels.md)."""

    select: Literal["all", "random", "uncertain"] = "all"
    """`all`: every compared pair (as before). `random`: `pairs` of them drawn at random. `uncertain`: the pairs the
    previous iteration's reward model is least sure of (the smallest score gap), where there is one (iteration 0
    draws at random); either way the held-out share of the asked pairs (`reward_model.eval_fraction`) is drawn at
    random first, so the reward model's accuracy is measured on pairs no margin chose."""
    pairs: int | None = Field(None, gt=0)
    """Pairs asked about per round of candidates (`random`, `uncertain`); unused with `all`."""


class RewardSource(_Frozen):
    """What scores the rollouts: a reward model learned from preferences, a reward function, or an environment."""

    source: Literal["reward_model", "function", "environment"] = "reward_model"
    """`reward_model`: learned each iteration from labelled candidate pairs (stages 1-3). `function`: the callable
    `reward.function` scores each response; no candidates are sampled, labelled or learned from. `environment`: the
    episode's reward is the sum of the turn rewards `environment.class` gives (docs/environments.md)."""
    function: str | None = None
    """With `source: function`, a `module:callable` called as `function(prompt, response, **columns)` (the prompt as
    written: text or chat messages; the prompt row's other columns as keyword arguments; docs/models.md) and
    returning a float, e.g. `demo.gold:gold_score`; looked up beside the config file too. Unused with `reward_model`."""


class EnvironmentSource(_Frozen):
    """The other side of multi-turn episodes (docs/environments.md): a class that answers the model's replies. Without
    one (`class` null) a rollout is one prompt and one response, as always."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    class_: str | None = Field(None, alias="class")
    """A `module:Class` constructed for each episode, with `reset(*, seed, row) -> str` (the first user message) and
    `step(action) -> (message | None, reward, done)`; looked up beside the config file too. Null: no episodes."""
    max_turns: int = Field(3, gt=0)
    """The most model turns of an episode; an episode still going then ends with stop reason `max_turns`."""
    max_tokens_per_turn: int = Field(32, gt=0)
    """The most tokens the model samples in one turn (a turn cut there is closed by the template's end of turn)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """How long one `reset` or `step` may take; past it the episode ends with stop reason `timeout`."""


class PipelineConfig(_Frozen):
    """Everything one campaign needs; validated once, when a flow starts.

    The defaults are for a real model: the stage configs' own defaults (``rlhf_core.config``), which
    follow TRL and OpenRLHF. Nothing of the embedded demo is on unless `demo` is true: its tiny model,
    prompts, hidden rubric and the sizes and learning rates tuned for it live in ``configs/demo.yaml``.
    """

    campaign: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Campaign name: the MLflow experiment and the folder under `run_root`. A campaign keeps the config it was
    started with (all but where and how it runs, `iterations`, the human-label forms and what a replay may change:
    the advantage and PPO settings): a different one needs a new name."""
    demo: bool = False
    """Use the embedded demo world: a tiny GPT-2 pretrained on a generated toy language (built and cached on first
    use) for whichever of `model.policy`, `data.prompts` and `data.eval_prompts` is not set, and its hidden gold
    rubric to judge evaluation (labeler `gold`). Only for models and prompts in the demo's language."""
    run_root: Path = Field(Path(".rlhf"), validate_default=True)
    """Folder for stage outputs, the MLflow SQLite store and caches (made absolute at load time)."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None uses SQLite at `<run_root>/mlflow.db`."""
    tracking_ui_url: str | None = None
    """Where the MLflow UI is (`http://HOST:PORT`), for the links the pipeline gives (the Prefect artifact's, the
    commands'); None: the tracking server itself with an `http(s)` `tracking_uri`, else http://127.0.0.1:5000."""
    seed: int = 0
    """Root seed; every stage derives its own from (seed, stage, iteration)."""
    iterations: int = Field(8, gt=0)
    """Iterations a campaign runs."""
    precision: Precision = "fp32"
    """Numeric precision of every forward pass: `fp32`, `bf16` or `fp16` (a GPU only). Trained weights stay fp32
    (Accelerate's mixed precision); frozen models are held in this precision; log-probs and losses are fp32. It
    changes the outputs, so unlike where they are computed (`execution`) it is part of the stages' input keys."""
    execution: ExecutionConfig = ExecutionConfig()
    labeler: LabelerName | None = None
    """Who labels candidate pairs when a reward model learns from them: an imported file (`import`, with
    `data.preferences`), a person answering Prefect UI forms (`human`), the current reward model
    (`reward_model`), your own rubric (`function`: `reward.function` prefers the response it scores higher), or the
    demo's hidden rubric (`gold`, with `demo` only). Needed unless the reward is a function or a pretrained reward
    model used as it is."""
    pairing: Pairing = "consecutive"
    """Which pairs of each prompt's candidates become preference pairs: `consecutive` ones, (0, 1), (2, 3), ..., ties
    kept; `best_vs_worse`, the best candidate against one it beats, drawn at random (UltraFeedback's binarised pairs:
    one per prompt); or `all_decisive`, every pair with a winner. The last two compare every pair of a prompt's
    candidates, so they need a labeler that scores each candidate: `function` or `gold` (`import` samples no
    candidates: the setting is unused)."""
    update: UpdateName = "ppo"
    """What each iteration's update learns from: `ppo`, rollouts scored by a reward (the reward model learned from the
    labels, or `reward.function`; any `advantages.estimator`); or `dpo`, the iteration's labelled pairs themselves (a
    direct preference update, `dpo`: candidates sampled and labelled, the reference's log-probs of the pairs, the
    update; no reward model, rollout or advantages). With labeler `import`, offline DPO: every iteration trains on
    the pairs of `data.preferences`, and nothing is sampled. docs/recipes.md."""
    model: ModelSource = ModelSource()
    data: DataSource = DataSource()
    sizes: IterationSizes = IterationSizes()
    human: HumanLabelConfig = HumanLabelConfig()
    asking: AskingConfig = AskingConfig()
    reward: RewardSource = RewardSource()
    environment: EnvironmentSource = EnvironmentSource()
    sampling: SamplingConfig = SamplingConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    ppo: PPOConfig = PPOConfig()
    dpo: DPOConfig = DPOConfig()
    """The direct preference update (`update: dpo` only)."""
    sft: SFTSection = SFTSection()
    """Supervised fine-tuning of the initial policy before iteration 0 (with `sft.data` only)."""

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, data: Any) -> Any:
        """A config written before a setting moved (:data:`MOVED_SETTINGS`), as a run recorded it, reads the same."""
        if not isinstance(data, dict):
            return data
        data = copy.deepcopy(data)
        move_settings(data)
        return data

    @field_validator("run_root")
    @classmethod
    def _absolute_run_root(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @model_validator(mode="after")
    def _demo_only_where_asked(self, info: ValidationInfo) -> PipelineConfig:
        """Nothing of the demo world reaches a campaign that did not ask for it (`demo`), and nothing is guessed."""
        if self.demo:
            return self
        missing = (
            []
            if _store_only(info)
            else [
                name
                for name, value in (
                    ("model.policy", self.model.policy),
                    ("data.prompts", self.data.prompts),
                    ("data.eval_prompts", self.data.eval_prompts),
                )
                if value is None
            ]
        )
        if missing:
            raise ValueError(
                f"set {', '.join(f'`{name}`' for name in missing)}: the model and prompts to train on "
                "(or run the embedded demo: --config configs/demo.yaml)"
            )
        if self.labeler == "gold":
            raise ValueError(
                "labeler gold is the embedded demo's hidden rubric for its toy language: with your own model set "
                "`labeler` to import (with `data.preferences`), human or reward_model"
            )
        if "function" in (self.reward.source, self.labeler) and (self.reward.function or "").startswith("demo."):
            raise ValueError(
                f"`reward.function` {self.reward.function} is the embedded demo's rubric for its toy language: "
                "name a function that scores your own model's responses"
            )
        return self

    @property
    def learns_from_labels(self) -> bool:
        """Whether each iteration labels candidate pairs for the reward model to train on."""
        return self.reward.source == "reward_model" and self.reward_model.train

    @model_validator(mode="after")
    def _update_has_what_it_reads(self, info: ValidationInfo) -> PipelineConfig:
        """`update: dpo` learns from labelled pairs and nothing else: refuse a campaign without a labeler, and the
        settings of what only a PPO iteration has (a reward, a critic, a rollout ahead), which would do nothing."""
        if self.update == "ppo":
            if self.dpo != DPOConfig():
                raise ValueError("`dpo` settings are read by `update` dpo only: set `update` dpo, or drop them")
            return self
        if self.labeler is None and not _store_only(info):
            raise ValueError(
                "`update` dpo learns from labelled pairs: set `labeler` (gold with `demo`, human, function with "
                "`reward.function`, reward_model with `model.reward_model`, or import with `data.preferences`)"
            )
        if self.data.preferences is not None and self.labeler != "import":
            raise ValueError(
                f"`data.preferences` is read by labeler import only (offline DPO on the file), not `labeler` "
                f"{self.labeler}, which labels sampled candidates: set `labeler` import, or drop `data.preferences`"
            )
        refused = {  # a setting of what a DPO iteration does not have -> what it does in a PPO one
            "reward.source": (self.reward.source != "reward_model", "a reward function scores the rollouts; to label "
                              "pairs with it, set `labeler` function"),
            "reward_model.train": (not self.reward_model.train, "a pretrained reward model scores the rollouts"),
            "model.critic_init": (self.model.critic_init != "policy", "where the critic starts"),
            "sampling.staleness": (self.sampling.staleness != 0, "rollouts sampled by older policies"),
        }  # fmt: skip
        for name, (given, does) in refused.items():
            if given:
                raise ValueError(
                    f"`{name}` is a setting of PPO iterations ({does}); `update` dpo trains on the labelled pairs "
                    "alone, with no reward, critic or rollout: leave it at its default"
                )
        return self

    @model_validator(mode="after")
    def _sft_has_its_data(self) -> PipelineConfig:
        if self.sft.data is None and self.sft.training != SFTConfig():
            raise ValueError("`sft` settings are read by the SFT stage, which `sft.data` adds: set it, or drop them")
        if self.sft.data is not None and self.sampling.engine != "hf":
            raise ValueError(
                f"`sft.data` with `sampling.engine` {self.sampling.engine}: the engine serves the pretrained policy as "
                "the base of what it samples, not the SFT model, in this version; set `sampling.engine` hf"
            )
        if self.sft.data is not None and self.model.lora is not None and self.execution.sharding is not None:
            raise ValueError(
                "`sft.data` with `model.lora` and a sharded `execution.accelerate_config`: the SFT output merges its "
                "adapters into a whole model, which one process does; train it unsharded or without LoRA"
            )
        return self

    @model_validator(mode="after")
    def _labeler_has_its_data(self, info: ValidationInfo) -> PipelineConfig:
        if self.learns_from_labels and self.labeler is None and not _store_only(info):
            raise ValueError(
                "set `labeler`: who labels the candidate pairs the reward model learns from (import with "
                "`data.preferences`, human, or reward_model with `model.reward_model`)"
            )
        if self.labeler == "reward_model" and self.learns_from_labels and self.model.reward_model is None:
            raise ValueError(
                "labeler reward_model needs `model.reward_model`: a pretrained reward model to label the first "
                "iteration's pairs (later iterations use the one they trained); or label with import or human"
            )
        if self.labeler == "import" and self.data.preferences is None:
            raise ValueError("labeler 'import' needs `data.preferences`: the file of preference pairs to import")
        if self.labeler == "function" and not self.reward.function:
            raise ValueError("labeler 'function' needs `reward.function`: the `module:callable` rubric that labels")
        if self.model.reward_model is None and not self.reward_model.train:
            raise ValueError(
                "`reward_model.train` false needs `model.reward_model`: the pretrained reward model to use"
            )
        if self.model.critic_init == "reward_model" and self.model.reward_model is None and not self.learns_from_labels:
            raise ValueError(
                "`model.critic_init` reward_model needs a reward model to start from: `model.reward_model`, or one the "
                "campaign trains (`reward.source` reward_model)"
            )
        if self.critic_from_trained_reward_model and not self.advantages.normalize_scores:
            raise ValueError(
                "`model.critic_init` reward_model starts the critic on the scale of the normalised scores (the reward "
                "model's held-out statistics folded into its head), so it needs `advantages.normalize_scores` true; "
                "or use critic_init policy"
            )
        scores_each = self.labeler in SCORING_LABELERS or self.labeler == "import"  # import labels no candidates
        if self.pairing != "consecutive" and self.learns_from_labels and not scores_each:
            raise ValueError(
                f"`pairing` {self.pairing} compares every pair of a prompt's candidates, which needs a labeler that "
                f"scores each candidate ({' or '.join(SCORING_LABELERS)}), not `labeler` {self.labeler}: use pairing "
                "consecutive"
            )
        labels_candidates = (self.learns_from_labels or self.update == "dpo") and self.labeler not in (None, "import")
        if (error := self._asking_error(labels_candidates)) is not None:
            raise ValueError(error)
        if self.sizes.decisive_pairs is not None and not labels_candidates:
            raise ValueError(
                "`sizes.decisive_pairs` samples rounds of candidates to label, and this campaign labels none ("
                + (
                    f"`labeler` {self.labeler}"
                    if self.labeler in (None, "import")
                    else "`reward.source` not reward_model"
                )
                + "): drop it"
            )
        pairs = self.pairs_per_iteration
        if self.learns_from_labels and self.labeler != "import" and pairs < MIN_PREFERENCE_PAIRS:
            raise ValueError(
                f"`sizes.preference_prompts` {self.sizes.preference_prompts} with `sizes.candidates_per_prompt` "
                f"{self.sizes.candidates_per_prompt} and `pairing` {self.pairing} gives at most {pairs} preference "
                f"pairs per iteration; the reward model needs at least {MIN_PREFERENCE_PAIRS}"
            )
        if self.learns_from_labels and self.labeler != "import" and self.update == "ppo":
            # The first iteration's pairs: later iterations train on these and their own.
            if (error := eval_split_error(pairs, self.reward_model.eval_fraction)) is not None:
                raise ValueError(f"{error} (`sizes.preference_prompts`, `sizes.candidates_per_prompt`, `pairing`)")
        return self

    @property
    def rewarded(self) -> bool:
        """Whether the campaign has a reward to score its policies with (a reward model, a reward function or an
        environment); a DPO update's has none."""
        return self.update == "ppo"

    @property
    def has_critic(self) -> bool:
        """Whether the campaign's policy has a critic: PPO updates with an estimator that uses one (GAE); a DPO
        update trains none."""
        return self.update == "ppo" and self.advantages.uses_critic

    @property
    def critic_from_trained_reward_model(self) -> bool:
        """Whether the critic starts from the first reward model the campaign trains (`model.critic_init`
        reward_model without a pretrained one): the campaign's start then has no critic."""
        return (
            self.advantages.uses_critic
            and self.model.critic_init == "reward_model"
            and self.model.reward_model is None
            and self.learns_from_labels
        )

    def _asking_error(self, labels_candidates: bool) -> str | None:
        """Why `asking` does not fit this campaign, or None."""
        select, budget = self.asking.select, self.asking.pairs
        if select == "all":
            return None
        if budget is None:
            return f"`asking.select` {select} asks about a budget of pairs a round: set `asking.pairs`"
        if not labels_candidates or self.labeler == "reward_model":
            return (
                f"`asking.select` {select} chooses the candidate pairs a labeler is asked about, and `labeler` "
                f"{self.labeler} is asked about none (or costs nothing): use asking.select all"
            )
        if self.pairing == "best_vs_worse":
            return (
                "`asking.select` asks about some of the compared pairs, and `pairing` best_vs_worse needs all of a "
                "prompt's to find its best candidate: use pairing consecutive or all_decisive"
            )
        return None

    @property
    def labeling_precision(self) -> Precision | None:
        """The precision the labeler computes in: the campaign's where a reward model is loaded (labeler
        ``reward_model`` judges; `asking.select` uncertain scores the candidates), None for the others, which load no
        model: their labels do not change with it, nor their keys."""
        loads_model = self.labeler == "reward_model" or self.asking.select == "uncertain"
        return self.precision if loads_model else None

    @property
    def pairs_per_iteration(self) -> int:
        """The most preference pairs an iteration's candidates give under `pairing` (ties drop some but with
        `consecutive`)."""
        prompts, candidates = self.sizes.preference_prompts, self.sizes.candidates_per_prompt
        per_prompt = {
            "consecutive": candidates // 2,
            "best_vs_worse": 1,
            "all_decisive": candidates * (candidates - 1) // 2,
        }[self.pairing]
        compared = prompts * per_prompt
        return (
            compared if self.asking.select == "all" or self.asking.pairs is None else min(compared, self.asking.pairs)
        )

    @model_validator(mode="after")
    def _estimator_fits_the_rollout(self) -> PipelineConfig:
        estimator, group = self.advantages.estimator, self.sizes.samples_per_prompt
        if estimator in GROUP_ESTIMATORS and group < 2:
            raise ValueError(
                f"`advantages.estimator` {estimator} compares the samples of each prompt: it needs "
                f"`sizes.samples_per_prompt` >= 2, got {group}"
            )
        rollouts = self.sizes.rollout_prompts * group
        if self.advantages.kl_target is not None and self.advantages.kl_horizon < rollouts:
            raise ValueError(
                f"`advantages.kl_horizon` {self.advantages.kl_horizon} is below the {rollouts} rollouts of an iteration "
                "(`sizes.rollout_prompts` x `sizes.samples_per_prompt`): the adaptive KL controller would move its "
                "coefficient by more than 20% in one iteration; raise `advantages.kl_horizon`"
            )
        if self.ppo.kl_loss_coef > 0 and self.advantages.kl_in != "loss":
            raise ValueError(
                f"`ppo.kl_loss_coef` {self.ppo.kl_loss_coef} puts the KL in the loss: set `advantages.kl_in` to loss "
                "(it is `reward`, which would count the KL twice)"
            )
        return self

    @model_validator(mode="after")
    def _tis_compares_like_with_like(self) -> PipelineConfig:
        # vLLM's log-probs of a filtered sample are those of the filtered distribution, the trainer's are over the
        # whole vocabulary: every TIS weight would fall below 1 (a silent cut of the learning rate; docs/engines.md)
        sampling = self.sampling
        if self.ppo.tis_cap is not None and (sampling.top_k > 0 or sampling.top_p < 1):
            raise ValueError(
                f"`ppo.tis_cap` weighs tokens by the trainer's probability over the sampler's, which top-k/top-p "
                f"filtering (`sampling.top_k` {sampling.top_k}, `sampling.top_p` {sampling.top_p}) makes unequal with "
                "identical weights: set top_k 0 and top_p 1, or drop `ppo.tis_cap`"
            )
        return self

    @model_validator(mode="after")
    def _reward_function_is_named(self) -> PipelineConfig:
        if self.reward.source == "function" and not self.reward.function:
            raise ValueError("`reward.source` function needs `reward.function`: a `module:callable`")
        return self

    @property
    def episodes(self) -> bool:
        """Whether rollouts are multi-turn episodes with `environment.class`."""
        return self.environment.class_ is not None

    @model_validator(mode="after")
    def _episodes_are_scored_by_their_environment(self) -> PipelineConfig:
        if self.reward.source == "environment" and not self.episodes:
            raise ValueError(
                "`reward.source` environment needs `environment.class`: a `module:Class` (docs/environments.md)"
            )
        if self.episodes and self.reward.source != "environment":
            raise ValueError(
                f"`environment.class` with `reward.source` {self.reward.source}: a learned or function reward of "
                "episodes is out of scope in this version; set `reward.source` environment (docs/environments.md)"
            )
        if self.episodes and self.labeler is not None:
            raise ValueError(
                f"`labeler` {self.labeler} with `environment.class`: labelling episodes for a reward model is out of "
                "scope in this version; drop `labeler` and use `reward.source` environment (docs/environments.md)"
            )
        return self


def _store_only(info: ValidationInfo) -> bool:
    """Whether the config is validated for a command that only reads the store (``load_config(store_only=True)``)."""
    return bool(info.context and info.context.get("store_only"))


class ConfigError(UserError, ValueError):
    """A config file or override that cannot be used; the message (one line) says which and why."""


class _DuplicateKey(ValueError):
    """A key given twice in one YAML mapping: ``(key, first line, second line)``."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping, where PyYAML keeps the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise _DuplicateKey(key, lines[key], line)
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted_key.split(".")
    for depth, part in enumerate(parents, start=1):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted_key}: `{'.'.join(parents[:depth])}` is not a section")
    node[leaf] = value


MOVED_SETTINGS = {
    "device": "execution.device",
    "torch_threads": "execution.torch_threads",
    "checkpoint_seconds": "execution.checkpoint_seconds",
    "model.gradient_checkpointing": "execution.gradient_checkpointing",
}
"""Old name -> new name of the settings that moved into `execution`, the one home of where and how work runs. A
config file or ``--set`` naming one the old way is read the new way with a notice (until the next release, which
refuses it); the config a run recorded (its ``config.json``, a deployment's parameters) silently, always: a
campaign is history, and its old runs stay readable."""


def move_settings(tree: dict[str, Any]) -> list[str]:
    """Move every setting ``tree`` gives under an old name (:data:`MOVED_SETTINGS`) to its new place, in place.

    Returns:
        The old names found.

    Raises:
        ValueError: a setting is given under both names.
    """
    moved = []
    for old, new in MOVED_SETTINGS.items():
        *parents, leaf = old.split(".")
        section = _get_dotted(tree, ".".join(parents)) if parents else tree
        if not isinstance(section, dict) or leaf not in section:
            continue
        if _get_dotted(tree, new) is not None:
            raise ValueError(f"`{old}` is the old name of `{new}`, and both are given: keep `{new}`")
        _set_dotted(tree, new, section.pop(leaf))
        moved.append(old)
    return moved


@functools.cache  # once per process and origin: a command may read its config twice (`rlhf config`, a replay)
def _tell_moved(old: str, origin: str) -> None:
    logger.warning(
        "%s: `%s` is now `%s`; the old name is read until the next release, which refuses it",
        origin,
        old,
        MOVED_SETTINGS[old],
    )


PATH_SETTINGS = (
    "run_root",
    "data.prompts",
    "data.eval_prompts",
    "data.preferences",
    "sft.data",
    "execution.accelerate_config",
)
"""Settings that are paths: relative ones in a config file are relative to its folder, given with ``--set`` to the
working directory (:func:`absolute_path`)."""
MODEL_SETTINGS = ("model.policy", "model.tokenizer", "model.reward_model")
"""Settings that are a folder, or a Hugging Face hub name (``org/name``) where no such folder exists."""


def absolute_path(setting: str, value: Any, folder: Path) -> Any:
    """``value`` of ``setting`` made absolute against ``folder``; a hub name, a ``pkg:`` file, a non-string or an
    absolute path as it is. A model setting is a hub name when it is ``org/name`` and no folder of that name is in
    ``folder``."""
    if (
        not isinstance(value, str) or not value or value.startswith("pkg:")
    ):  # a file in a package (campaign.model_sources)
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    resolved = (folder / path).resolve()
    hub_name = not value.startswith((".", "~")) and value.count("/") == 1 and not resolved.exists()
    return value if setting in MODEL_SETTINGS and hub_name else str(resolved)


def _get_dotted(tree: dict[str, Any], dotted_key: str) -> Any:
    node: Any = tree
    for part in dotted_key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _absolute_paths(tree: dict[str, Any], folder: Path) -> None:
    """Every path setting of a config file's ``tree`` made absolute against the file's ``folder`` (in place)."""
    for setting in PATH_SETTINGS + MODEL_SETTINGS:
        value = _get_dotted(tree, setting)
        if isinstance(value, str):
            _set_dotted(tree, setting, absolute_path(setting, value, folder))


def parse_override(text: str) -> tuple[str, Any]:
    """``"ppo.epochs=2"`` -> ``("ppo.epochs", 2)``; the value is parsed as YAML, an old name
    (:data:`MOVED_SETTINGS`) is given as the new one, with a notice.

    Raises:
        ConfigError: not ``key=value``, or the value is not YAML (``[1,``).
    """
    key, separator, raw = text.partition("=")
    key = key.strip()
    if not separator or not key:
        raise ConfigError(f"--set {text}: an override must look like `section.field=value`")
    if key in MOVED_SETTINGS:
        _tell_moved(key, f"--set {text}")
        key = MOVED_SETTINGS[key]
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {text}: the value is not valid YAML ({_yaml_problem(error)})") from error


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what and where (PyYAML's own message spans several)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def setting_names(model: type = PipelineConfig, prefix: str = "") -> list[str]:
    """Every config field as a dotted path (``ppo.clip_eps``), sections included."""
    if dataclasses.is_dataclass(model):
        children = {f.name: None for f in dataclasses.fields(model)}
    else:
        children = {name: info.annotation for name, info in model.model_fields.items()}
    names = []
    for name, annotation in children.items():
        names.append(prefix + name)
        if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
            names.extend(setting_names(annotation, f"{prefix}{name}."))
    return names


def _problem(error: dict[str, Any]) -> tuple[str, str]:
    """``(dotted setting or "" for a check across fields, the problem in words)`` of one pydantic error."""
    location = [str(part) for part in error["loc"]]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, SettingError):
        name = ".".join([*location, cause.field])
        return name, f"`{name}` {cause.problem}"
    name = ".".join(location)
    if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        close = difflib.get_close_matches(name, setting_names(), n=1)
        return name, f"`{name}` is not a setting" + (f" (did you mean `{close[0]}`?)" if close else "")
    message = error["msg"].removeprefix("Value error, ")
    if not name:
        return name, message
    value = error.get("input")
    got = f", got {value!r}" if not isinstance(value, dict) and error["type"] != "value_error" else ""
    return name, f"`{name}`: {message[:1].lower()}{message[1:]}{got}"


def describe_errors(error: ValidationError, *, overrides: dict[str, str], path: Path | None) -> str:
    """A config validation error in one line: the first problem, the setting it names and where that came from."""
    problems = error.errors()
    name, problem = _problem(problems[0])
    origin = next(
        (f"--set {text}" for key, text in overrides.items() if name == key or name.startswith(key + ".")),
        f"in {path}" if path is not None and name else "",
    )
    more = f"; and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
    return f"{problem}{f' ({origin})' if origin else ''}{more}"


def load_config(
    path: Path | None = None, overrides: list[str] | tuple[str, ...] = (), *, store_only: bool = False
) -> PipelineConfig:
    """Read a YAML config (a diff from the defaults), apply ``key=value`` overrides, validate.

    Relative paths (:data:`PATH_SETTINGS`, :data:`MODEL_SETTINGS`) are made absolute: those in the file against its
    folder, those of an override against the working directory, so every message names the path it looked at.

    Args:
        store_only: for commands that only read what runs recorded (compare, export, gc): what only a run
            needs (a model, prompts, a labeler) need not be set.

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed, or validation fails; the
            message names the setting, and the override or file it came from.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as error:
            key, first, second = error.args
            raise ConfigError(
                f"config file {path}: `{key}` is given twice, at lines {first} and {second} (YAML would keep only the "
                "last): merge them"
            ) from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(error)}") from error
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"config file {path} cannot be read: {error}") from error
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(tree).__name__}")
        _absolute_paths(tree, Path(path).absolute().parent)
        try:
            moved = move_settings(tree)
        except ValueError as error:
            raise ConfigError(f"config file {path}: {error}") from None
        for old in moved:
            _tell_moved(old, f"config file {path}")
    given: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(
            tree, key, absolute_path(key, value, Path.cwd()) if key in PATH_SETTINGS + MODEL_SETTINGS else value
        )
        given[key] = text
    try:
        return PipelineConfig.model_validate(tree, context={"store_only": store_only})
    except ValidationError as error:
        raise ConfigError(describe_errors(error, overrides=given, path=path)) from error


def commented_yaml(config: PipelineConfig) -> str:
    """``config`` as YAML, each field preceded by its description as a comment (what ``rlhf config`` prints); it
    loads back as the same config."""
    schema = PipelineConfig.model_json_schema()
    definitions = schema["$defs"]
    lines: list[str] = []

    def section(properties: dict[str, Any], values: dict[str, Any], indent: str) -> None:
        for name, value in values.items():
            field = properties.get(name, {})
            refs = [field.get("$ref"), *(option.get("$ref") for option in field.get("anyOf", []))]
            definition = next((definitions[ref.rsplit("/", 1)[-1]] for ref in refs if ref), None)
            description = field.get("description") or (definition or {}).get("description", "")
            lines.extend(f"{indent}# {line}" for line in textwrap.wrap(" ".join(description.split()), 100))
            if isinstance(value, dict) and definition is not None:
                lines.append(f"{indent}{name}:")
                section(definition["properties"], value, indent + "  ")
            else:  # JSON is YAML: strings quoted, null and lists as they are
                lines.append(f"{indent}{name}: {json.dumps(value)}")

    section(schema["properties"], config.model_dump(mode="json"), "")
    return "\n".join(lines) + "\n"
