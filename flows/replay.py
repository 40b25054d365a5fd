"""Finding recorded runs and building a replay's config.

A replay takes the config its source iteration was run with (stored beside the run as
``config.json``) and changes only what can change without generating again: the settings that
only the replayed stages receive (:func:`campaign.settings.replayable_fields`: the advantage and PPO
settings and how many held-out prompts evaluation uses), plus where and how stages run.

The advantage estimator may change too, as far as the stored experience allows
(:func:`check_replay_data`): a group estimator needs every prompt sampled at least twice, and GAE
needs the critic values of a rollout made with a critic.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import ValidationError

from campaign.config import ConfigError, PipelineConfig, _set_dotted, describe_errors, parse_override
from campaign.settings import LOCATION, changeable_fields, covers
from campaign.store import source_config
from rlhf_core.config import GROUP_ESTIMATORS
from runtime.declaration import StageResult
from storage.schemas import OLD_VALUES, PROMPT_ID
from storage.shards import read_table


def _refusal(fields: list[str]) -> ConfigError:
    return ConfigError(
        f"a replay cannot change {', '.join(f'`{field}`' for field in fields)}: only "
        f"{', '.join(changeable_fields())} (everything else needs new rollouts)"
    )


def replay_config(config: PipelineConfig, source_run_id: str, overrides: list[str]) -> PipelineConfig:
    """The source run's config with ``overrides`` applied; refuses changes a replay cannot honour.

    Where the store is (``run_root``, ``tracking_uri``) comes from ``config``, not the source run. An
    override that sets a field to the value the source run had changes nothing and is accepted, so
    the command that ran the campaign can replay it with the same ``--set`` options.
    """
    return with_replay_changes(source_config(config, source_run_id), overrides, location=config)


def with_replay_changes(source: PipelineConfig, overrides: list[str], *, location: PipelineConfig) -> PipelineConfig:
    """``source`` (the config an iteration ran with) with ``overrides`` applied and the store of ``location``.

    Raises:
        ConfigError: an override a replay cannot honour (see :func:`forbidden_changes`), or an estimator the
            source's rollout cannot serve.
    """
    tree: dict[str, Any] = source.model_dump(mode="json")
    for field in LOCATION:
        tree[field] = getattr(location, field) if field != "run_root" else str(location.run_root)
    given: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        if key in LOCATION:
            continue
        _set_dotted(tree, key, value)
        given[key] = text
    estimator, group = tree["advantages"].get("estimator"), tree["sizes"]["samples_per_prompt"]
    if estimator in GROUP_ESTIMATORS and group < 2:
        raise ConfigError(
            f"a replay with `advantages.estimator` {estimator} needs groups of samples of each prompt, but the source "
            f"iteration rolled out `sizes.samples_per_prompt` {group}; a replay generates nothing, so replay an "
            "iteration rolled out with samples_per_prompt >= 2, or use gae or reinforce_pp"
        )
    try:
        replay = PipelineConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(f"replay config: {describe_errors(error, overrides=given, path=None)}") from error
    if changed := forbidden_changes(replay, source):
        raise _refusal(changed)
    return replay


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def forbidden_changes(config: PipelineConfig, source: PipelineConfig) -> list[str]:
    """The fields in which ``config`` differs from ``source`` that a replay may not change, sorted."""
    given = _flat(config.model_dump(mode="json"))
    before = _flat(source.model_dump(mode="json"))
    return sorted(
        key
        for key in given.keys() | before.keys()
        if given.get(key) != before.get(key) and not covers(changeable_fields(), key)
    )


def check_replayable(config: PipelineConfig, source_run_id: str) -> None:
    """Refuse a replay config that differs from its source run's in anything but changeable fields.

    The command line builds replay configs that pass; this guards replays started any other way
    (a deployment triggered from the Prefect UI, a script).
    """
    if changed := forbidden_changes(config, source_config(config, source_run_id)):
        raise _refusal(changed)


def check_replay_data(config: PipelineConfig, experience: StageResult) -> None:
    """Refuse an estimator the stored experience cannot serve, before the replay records or runs anything.

    Raises:
        ConfigError: a group estimator and a prompt sampled once, or GAE and a rollout without critic values.
    """
    table = read_table(experience.directory, "experience")
    estimator = config.advantages.estimator
    if estimator in GROUP_ESTIMATORS:
        sizes = Counter(table.column(PROMPT_ID).to_pylist())
        lonely = sorted(prompt for prompt, size in sizes.items() if size < 2)
        if lonely:
            raise ConfigError(
                f"`advantages.estimator` {estimator} needs at least 2 samples of every prompt, but the source rollout "
                f"sampled {len(lonely)} of its {len(sizes)} prompts once (prompt ids "
                f"{', '.join(map(str, lonely[:5]))}{', ...' if len(lonely) > 5 else ''})"
            )
    if config.advantages.uses_critic and table.column(OLD_VALUES).null_count:
        raise ConfigError(
            f"`advantages.estimator` {estimator} needs critic values, but the source iteration rolled out without a "
            "critic (a critic-free estimator): replay it with grpo, dr_grpo, rloo or reinforce_pp"
        )
