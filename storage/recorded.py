"""The folder of a stage output a run recorded in MLflow: in the campaign's layout, downloaded there if missing.

What continuing, replaying (``runtime.records``) and inspecting (``flows.inspection``) a campaign all start from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from storage.layout import RunLayout
from storage.manifest import MANIFEST_FILE, Manifest, find_stage_output, read_manifest
from storage.tracking import TAG_INPUT_KEY, TAG_STAGE, Tracker


def recorded_output(
    tracker: Tracker,
    layout: RunLayout,
    run_id: str,
    *,
    tags: Mapping[str, str] | None = None,
    verify: bool = True,
) -> tuple[Path, Manifest]:
    """The output folder of the stage run ``run_id`` and its manifest.

    The folder is ``layout.stage_dir(stage, input_key)``; when it holds no finished output (a tracking server
    keeps the only copy, or the run root moved), the run's output is downloaded (or copied) there and verified.

    Args:
        tracker: the campaign's store.
        layout: the campaign's folder.
        run_id: the stage run.
        tags: the run's tags, when the caller has them already (one query fewer).
        verify: hash every file of an output found in place against its manifest; a reader that only reads
            (``rlhf inspect``) passes False and trusts a folder whose manifest names the run's input key.

    Raises:
        MissingOutputError: the run recorded its output by reference and that folder is gone.
        CorruptOutputError: the output does not match its manifest.
    """
    tags = tracker.run(run_id).tags if tags is None else tags
    stage, input_key = tags[TAG_STAGE], tags[TAG_INPUT_KEY]
    stage_dir = layout.stage_dir(stage, input_key)
    if verify:
        manifest = find_stage_output(stage_dir, input_key)
    elif (stage_dir / MANIFEST_FILE).is_file():
        manifest = read_manifest(stage_dir, verify=False)
        manifest = manifest if manifest.input_key == input_key else None
    else:
        manifest = None
    if manifest is None:
        tracker.download_stage_output(run_id, stage_dir)
        manifest = read_manifest(stage_dir)
    return stage_dir, manifest
