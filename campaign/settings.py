"""What each stage receives, as the campaign sees it: the settings table, derived from the stages' declarations
(:mod:`tasks.settings`), and the replay rules derived from it.

Each stage declares its settings once, each by the config field (a dotted path) or base input (``base.<field>``)
it reads (:mod:`runtime.declaration`). :data:`STAGE_SETTINGS` is that, per stage, so what a replay may change is
derived, not kept by hand (:func:`replayable_fields`): the settings the replayed stages receive, minus those a stage
of the iteration it reuses also received.

Settings of :data:`EXECUTION` (where and how stages run) and :data:`LOCATION` (where the store is) reach no input key
and may always change.
"""

from __future__ import annotations

from runtime.declaration import BASE, setting_paths
from tasks.settings import STAGES

STAGE_SETTINGS: dict[str, dict[str, str]] = {settings.stage: setting_paths(settings) for settings in STAGES}
"""stage -> {setting: config path (a field, or a property such as ``advantages.uses_critic``) or ``base.<field>``}."""

REPLAYED_STAGES = ("compute_advantages", "ppo_update", "dpo_update", "sample_reference", "evaluate")
"""The stages a replay runs again (the reference's samples are the campaign's, reused unless a replay's evaluation
settings ask for others; a DPO iteration has no advantages, and its update reads the reference's stored log-probs);
every other stage's output is reused from the source iteration."""
CAMPAIGN_START = ("sft", "initialize")
"""Stages that run once per campaign, before its first iteration. What they received shaped the policy a replay
starts from, as an earlier iteration's settings did, but no stage of the replayed iteration reads it again."""

EXECUTION = ("execution",)
"""Where and how stages run (:class:`runtime.execution.ExecutionConfig`, every field of it): part of no input key, so a
campaign can continue elsewhere."""
LOCATION = ("run_root", "tracking_uri", "tracking_ui_url")
"""Where the store is."""


def replayable_fields() -> tuple[str, ...]:
    """Config paths a replay may change: read by a replayed stage and by no stage of the iteration it reuses.

    A base input is never among them (it is part of every input key), nor a setting derived from the config's fields
    (a property of it, such as ``rewarded``: what it derives from is what a replay would have to change), nor is
    anything a reused stage read: the rollout's ``sampling`` must stay what generated the experience. A path inside
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
        if not path.startswith(BASE)
        and not _derived(path)
        and not any(covers((other,), path) or covers((path,), other) for other in reused)
    }
    return tuple(sorted(path for path in allowed if not covers(tuple(allowed - {path}), path)))


def changeable_fields() -> tuple[str, ...]:
    """Every config path a replay may set: the replayable settings (:func:`replayable_fields`), execution and
    location."""
    return replayable_fields() + EXECUTION + LOCATION


def covers(paths: tuple[str, ...], field: str) -> bool:
    """Whether ``field`` (a dotted path) is one of ``paths`` or lies inside one of them."""
    return any(field == path or field.startswith(path + ".") for path in paths)


def _derived(path: str) -> bool:
    """Whether ``path`` names a property of the campaign's config (a setting derived from its fields), not a field."""
    from campaign.config import PipelineConfig

    return isinstance(getattr(PipelineConfig, path.split(".")[0], None), property)
