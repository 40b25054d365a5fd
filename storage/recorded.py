"""The folder of a stage output a run recorded in MLflow: in the campaign's layout, downloaded there if missing.

What continuing, replaying (``tasks.records``) and inspecting (``flows.inspect``) a campaign all start from.
"""

from __future__ import annotations

from pathlib import Path

from storage.layout import RunLayout
from storage.manifest import Manifest, find_stage_output, read_manifest
from storage.tracking import TAG_INPUT_KEY, TAG_STAGE, Tracker


def recorded_output(tracker: Tracker, layout: RunLayout, run_id: str) -> tuple[Path, Manifest]:
    """The output folder of the stage run ``run_id`` and its manifest.

    The folder is ``layout.stage_dir(stage, input_key)``; when it holds no finished output (a tracking server
    keeps the only copy, or the run root moved), the run's output is downloaded (or copied) there and verified.

    Raises:
        MissingOutputError: the run recorded its output by reference and that folder is gone.
        CorruptOutputError: the output does not match its manifest.
    """
    tags = tracker.run_tags(run_id)
    stage, input_key = tags[TAG_STAGE], tags[TAG_INPUT_KEY]
    stage_dir = layout.stage_dir(stage, input_key)
    manifest = find_stage_output(stage_dir, input_key)
    if manifest is None:
        tracker.download_stage_output(run_id, stage_dir)
        manifest = read_manifest(stage_dir)
    return stage_dir, manifest
