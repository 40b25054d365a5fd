"""A stage's record: its output logged in MLflow as a nested run, and what it did told to the person and the UI.

Recording a stage in MLflow is idempotent: a stage run that an earlier attempt left unfinished (its process was
killed while copying artifacts, say) is finished in place, never recorded a second time (:func:`record_stage`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError
from prefect.states import Completed, State

from runtime.context import StageContext
from runtime.declaration import StageResult
from runtime.registry import record_models
from storage.holds import hold
from storage.manifest import Manifest
from storage.schemas import SAMPLES
from storage.tracking import (
    KIND_STAGE,
    TAG_CAMPAIGN,
    TAG_FLOW_RUN_ID,
    TAG_INPUT_KEY,
    TAG_ITERATION,
    TAG_KIND,
    TAG_STAGE,
    TAG_UPSTREAM_PREFIX,
    Tracker,
)

logger = logging.getLogger(__name__)


def stage_state(result: StageResult) -> State:
    """The task's final state: ``Reused`` in the Prefect UI when nothing ran, else ``Completed``."""
    if result.reused:
        return Completed(data=result, name="Reused", message=f"reused {result.stage} output {result.input_key[:16]}")
    return Completed(data=result, message=f"wrote {result.stage} output {result.input_key[:16]}")


def announce(message: str, extra: dict[str, Any]) -> None:
    """Log what a stage does in its Prefect task log (the run logger, so the Prefect UI shows it), or on this
    module's logger outside a run; ``extra`` marks the record for the console (:mod:`flows.console`)."""
    try:
        run_logger: logging.Logger | logging.LoggerAdapter = get_run_logger()
    except MissingContextError:
        run_logger = logger
    run_logger.info(message, extra=extra)


def describe_result(result: StageResult) -> str:
    """What a stage did, in one line for its task log: ran or reused, where its output is, every metric."""
    metrics = ", ".join(f"{name} {value:.4g}" for name, value in sorted(result.metrics.items()) if name != "seconds")
    seconds = result.metrics.get("seconds")
    if result.reused:
        did = "reused its output"
    else:
        did = "ran" + (f" in {seconds:.1f} s" if seconds is not None else "") + ", wrote"
    return f"{result.stage}: {did} {result.directory} (MLflow run {result.run_id}); {metrics}"


def record_stage(
    context: StageContext,
    tracker: Tracker,
    stage: str,
    settings: dict[str, Any],
    manifest: Manifest,
    stage_dir: Path,
    register: Mapping[str, str] | None,
) -> str:
    """Log a finished stage output as a nested MLflow run (params, metrics, artifacts, datasets, models).

    A run an earlier attempt left unfinished for this input key is finished instead of starting another:
    its ``output/`` artifacts are cleared and logged again, and what it already holds is not logged twice. A failure
    while recording ends the run FAILED (KILLED on Ctrl-C), so it never stays RUNNING.
    """
    run_id = tracker.find_unfinished_stage_run(context.experiment_id, stage, manifest.input_key)
    reopened = run_id is not None  # what it holds is not logged twice; a run just started holds nothing to read
    if not reopened:
        tags = {
            TAG_CAMPAIGN: context.campaign,
            TAG_ITERATION: str(context.iteration),
            TAG_STAGE: stage,
            TAG_KIND: KIND_STAGE,
            TAG_INPUT_KEY: manifest.input_key,  # from the start, so an interrupted record can be found
            **{f"{TAG_UPSTREAM_PREFIX}{name}": digest for name, digest in manifest.upstream.items()},
        }
        if context.flow_run_id:
            tags[TAG_FLOW_RUN_ID] = context.flow_run_id
        run_id = tracker.start_run(context.experiment_id, name=stage, tags=tags, parent_run_id=context.parent_run_id)
    else:
        logger.info("%s: finishing MLflow run %s, whose recording was interrupted", stage, run_id)
        tracker.reopen_run(run_id)
        tracker.clear_stage_output(run_id)
    with tracker.ends_on_error(run_id):
        tracker.log_params(run_id, settings)
        metrics = {f"{stage}/{name}": value for name, value in manifest.metrics.items()}
        tracker.log_metrics(run_id, metrics, step=context.iteration, skip_logged=reopened)
        curve = stage_dir / TRAINING_CURVE
        if curve.is_file():
            steps = json.loads(curve.read_text())
            tracker.log_metric_steps(run_id, f"{stage}/train", steps, skip_logged=reopened)
        samples = stage_dir / SAMPLES
        if samples.is_file():
            rows = [json.loads(line) for line in samples.read_text().splitlines()]
            tracker.log_table(run_id, {name: [row.get(name) for row in rows] for name in rows[0]}, "samples.json")
        tracker.log_stage_output(run_id, stage_dir, manifest)
        hold(stage, "recording")
        record_models(context, run_id, manifest, stage_dir, register)
        tracker.end_run(run_id)
    return run_id


TRAINING_CURVE = "training_curve.json"
"""A training stage's per-step statistics in its output: ``[{"step": 1, "loss": ...}, ...]``, logged in MLflow as
``<stage>/train/<name>`` at each step (:func:`record_stage`), so the UI draws curves, not one point per stage."""


def write_training_curve(folder: Path, rows: list[dict[str, float]]) -> None:
    """Write ``rows`` (one per optimizer step, each with its ``step``) as the output's :data:`TRAINING_CURVE`."""
    (folder / TRAINING_CURVE).write_text(json.dumps(rows, sort_keys=True))  # the same text after a resume
