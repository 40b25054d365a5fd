"""The MLflow store and run folders of a config, and finding recorded runs (by name, the stage runs an iteration
used, the config it was made with): what commands that only read the store (``rlhf compare``, the reports) need,
importing neither torch nor Prefect, so they start in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from campaign.config import PipelineConfig
from storage.layout import RunLayout

if TYPE_CHECKING:  # MLflow is imported when a store is opened: locating the inputs (campaign.identity) needs none
    from storage.tracking import Tracker


def campaign_layout(config: PipelineConfig) -> RunLayout:
    """The campaign's folder: ``run_root / campaign``."""
    return RunLayout(root=config.run_root / config.campaign)


def store_layout(config: PipelineConfig) -> RunLayout:
    """The layout of ``run_root`` itself: one MLflow store and cache for every campaign under it."""
    return RunLayout(root=config.run_root)


def tracking_uri(config: PipelineConfig) -> str:
    """The config's tracking URI, or SQLite at ``run_root/mlflow.db``."""
    return config.tracking_uri or store_layout(config).tracking_uri()


def artifact_root(config: PipelineConfig) -> Path | None:
    """Where a local store keeps artifacts; None for a tracking server, which keeps them where its
    ``--artifacts-destination`` says."""
    return None if tracking_uri(config).startswith(("http://", "https://")) else store_layout(config).artifact_root()


def store_tracker(config: PipelineConfig) -> Tracker:
    """The :class:`Tracker` of ``config``'s store (one per store and process)."""
    from storage.tracking import open_tracker

    root = artifact_root(config)
    return open_tracker(tracking_uri(config), None if root is None else str(root), config.tracking_ui_url)


def existing_tracker(config: PipelineConfig) -> Tracker | None:
    """The tracker of ``config``'s store, or None for a local store that does not exist yet (none is created)."""
    if config.tracking_uri is None and not store_layout(config).mlflow_db().is_file():
        return None
    return store_tracker(config)


def resolve_run(config: PipelineConfig, name: str) -> str:
    """An MLflow run id from a run id, ``CAMPAIGN:ITERATION``, or ``CAMPAIGN`` (its latest iteration).

    Raises:
        LookupError: no such run, campaign or iteration, or no MLflow store at all (none is created).
    """
    database = store_layout(config).mlflow_db()
    if config.tracking_uri is None and not database.exists():
        raise LookupError(f"no MLflow store at {database}: nothing has run with `run_root` {config.run_root}")
    tracker = store_tracker(config)
    campaign, _, iteration = name.partition(":")
    try:
        experiment_id = tracker.experiment_id(campaign) if tracker.has_experiment(campaign) else None
    except ValueError:
        experiment_id = None
    if experiment_id is None:
        if ":" in name:
            raise LookupError(f"no campaign {campaign!r} in the MLflow store {tracker.tracking_uri}")
        try:
            tracker.run(name)
        except LookupError as error:
            raise LookupError(f"{name!r} is neither a campaign nor a run id in {tracker.tracking_uri}") from error
        return name
    finished = tracker.finished_iterations(experiment_id)
    if not finished:
        raise LookupError(f"campaign {campaign!r} has no finished iteration")
    run = finished[max(finished)] if not iteration else finished.get(int(iteration)) if iteration.isdigit() else None
    if run is None:
        raise LookupError(f"campaign {campaign!r} has no finished iteration {iteration}")
    return run.run_id


CONFIG_ARTIFACT = "config.json"
"""The artifact of an iteration (or replay) run holding the config it was made with."""


def source_config(config: PipelineConfig, source_run_id: str) -> PipelineConfig:
    """The config an iteration run was made with (its :data:`CONFIG_ARTIFACT`), from ``config``'s store."""
    return PipelineConfig.model_validate_json(store_tracker(config).load_text(source_run_id, CONFIG_ARTIFACT))


def stage_run(
    tracker: Tracker, experiment_id: str, parent_run_id: str, stage: str, *, required: bool = True
) -> str | None:
    """The stage run whose output an iteration (or replay) run used: its own, or a reused one.

    Raises:
        LookupError: the run records none and ``required`` is set (else None is returned: an
            iteration with a reward function has no reward-model stage).
    """
    from storage.tracking import TAG_OUTPUT_PREFIX, TAG_PARENT_RUN_ID, TAG_STAGE

    run_id = tracker.run(parent_run_id).tags.get(f"{TAG_OUTPUT_PREFIX}{stage}") or tracker.find_run(
        experiment_id, tags={TAG_PARENT_RUN_ID: parent_run_id, TAG_STAGE: stage}, status="FINISHED"
    )  # runs recorded before the output tags existed: their own nested stage run
    if run_id is None and required:
        raise LookupError(f"run {parent_run_id} records no finished {stage!r} output")
    return run_id
