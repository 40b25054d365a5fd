"""What each stage receives: the one table the flows call stages with and the replay rules derive from.

Every stage task takes its settings as keyword arguments, and its input key is derived from
exactly those (:mod:`runtime.stage`). :data:`STAGE_SETTINGS` says, per stage, which config field
(a dotted path) or base input (``base.<field>``) each argument is, so:

* the flows call ``stage(context, *upstream, **stage_settings(config, base, stage))``;
* what a replay may change is derived, not kept by hand (:func:`replayable_fields`): the
  settings the replayed stages receive, minus those a stage of the iteration it reuses also
  received.

Settings of :data:`EXECUTION` (where and how stages run) and :data:`LOCATION` (where the store
is) reach no input key and may always change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from campaign.config import PipelineConfig

if TYPE_CHECKING:  # the CLI reads what a replay may change while it builds its parser: no MLflow import for that
    from runtime.context import BaseInputs

STAGE_SETTINGS: dict[str, dict[str, str]] = {
    "initialize": {"critic": "advantages.uses_critic", "lora": "model.lora", "critic_init": "model.critic_init"},
    "sample_candidates": {
        "sampling": "sampling",
        "precision": "precision",
        "prompts": "sizes.preference_prompts",
        "candidates_per_prompt": "sizes.candidates_per_prompt",
        "rows_per_shard": "sizes.rows_per_shard",
    },
    "human_labels": {"relabel": "human.relabel"},
    "collect_preferences": {
        "labeler": "labeler",
        "judge": "base.judge",
        "rubric": "base.rubric",
        "preferences": "base.preferences",
        "precision": "precision",
        "rows_per_shard": "sizes.rows_per_shard",
    },
    "train_reward_model": {"reward_model": "reward_model", "precision": "precision", "lora": "model.lora"},
    "rollout": {
        "sampling": "sampling",
        "precision": "precision",
        "prompts": "sizes.rollout_prompts",
        "samples_per_prompt": "sizes.samples_per_prompt",
        "rows_per_shard": "sizes.rows_per_shard",
        "reward_function": "base.reward_function",
    },
    "compute_advantages": {"advantages": "advantages", "rows_per_shard": "sizes.rows_per_shard"},
    "ppo_update": {
        "ppo": "ppo",
        "critic": "advantages.uses_critic",
        "precision": "precision",
        "temperature": "sampling.temperature",
        "max_new_tokens": "sampling.max_new_tokens",
    },
    "evaluate": {
        "sampling": "sampling",
        "precision": "precision",
        "prompts": "sizes.eval_prompts",
        "judge": "base.judge",
        "rubric": "base.rubric",
        "reward_function": "base.reward_function",
        "rows_per_shard": "sizes.rows_per_shard",
    },
}
"""stage -> {argument: config path (a field, or a property such as ``advantages.uses_critic``) or ``base.<field>``}."""

REPLAYED_STAGES = ("compute_advantages", "ppo_update", "evaluate")
"""The stages a replay runs again; every other stage's output is reused from the source iteration."""
CAMPAIGN_START = ("initialize",)
"""Stages that run once per campaign, before its first iteration. What they received shaped the policy a replay
starts from, as an earlier iteration's settings did, but no stage of the replayed iteration reads it again."""

EXECUTION = ("execution",)
"""Where and how stages run (:class:`campaign.config.ExecutionConfig`, every field of it): part of no input key, so a
campaign can continue elsewhere."""
LOCATION = ("run_root", "tracking_uri", "tracking_ui_url")
"""Where the store is."""

_BASE = "base."


def config_value(config: PipelineConfig, path: str) -> Any:
    """The value at a dotted path of the config (``sizes.eval_prompts``)."""
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def stage_settings(config: PipelineConfig, base: BaseInputs, stage: str) -> dict[str, Any]:
    """The keyword arguments ``stage`` is called with."""
    return {
        argument: getattr(base, path[len(_BASE) :]) if path.startswith(_BASE) else config_value(config, path)
        for argument, path in STAGE_SETTINGS[stage].items()
    }


def replayable_fields() -> tuple[str, ...]:
    """Config paths a replay may change: read by a replayed stage and by no stage of the iteration it reuses.

    A base input is never among them (it is part of every input key), nor is anything a reused
    stage read: the rollout's ``sampling`` must stay what generated the experience. A path inside
    another replayable one (``advantages.uses_critic`` in ``advantages``) is not listed twice.
    """
    replayed = {path for stage in REPLAYED_STAGES for path in STAGE_SETTINGS[stage].values()}
    reused = {
        path
        for stage, paths in STAGE_SETTINGS.items()
        if stage not in REPLAYED_STAGES + CAMPAIGN_START
        for path in paths.values()
    }
    allowed = {
        path
        for path in replayed
        if not path.startswith(_BASE) and not any(covers((other,), path) or covers((path,), other) for other in reused)
    }
    return tuple(sorted(path for path in allowed if not covers(tuple(allowed - {path}), path)))


def changeable_fields() -> tuple[str, ...]:
    """Every config path a replay may set: the replayable settings (:func:`replayable_fields`), execution and
    location."""
    return replayable_fields() + EXECUTION + LOCATION


def covers(paths: tuple[str, ...], field: str) -> bool:
    """Whether ``field`` (a dotted path) is one of ``paths`` or lies inside one of them."""
    return any(field == path or field.startswith(path + ".") for path in paths)
