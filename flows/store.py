"""The MLflow store and run folders of a config, and finding recorded runs: what commands that only read the store
(``rlhf compare``, the reports) need, importing neither torch nor Prefect, so they start in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flows.config import PipelineConfig
from storage.layout import RunLayout

if TYPE_CHECKING:  # MLflow is imported when a store is opened: the input checks (flows.identity) need none
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
    from storage.tracking import KIND_ITERATION, TAG_ITERATION, TAG_KIND

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
            tracker.run_tags(name)
        except Exception as error:  # noqa: BLE001 - MLflow raises its own exception type for a missing run
            raise LookupError(f"{name!r} is neither a campaign nor a run id in {tracker.tracking_uri}") from error
        return name
    if not iteration:
        latest = tracker.latest_iteration(experiment_id)
        if latest is None:
            raise LookupError(f"campaign {campaign!r} has no finished iteration")
        iteration = str(latest)
    run_id = tracker.find_run(
        experiment_id, tags={TAG_KIND: KIND_ITERATION, TAG_ITERATION: iteration}, status="FINISHED"
    )
    if run_id is None:
        raise LookupError(f"campaign {campaign!r} has no finished iteration {iteration}")
    return run_id
