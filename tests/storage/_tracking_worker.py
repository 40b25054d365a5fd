"""Run in a spawned process by test_tracking: write one stage, start to finish, into a shared store."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from storage.layout import RunLayout
from storage.manifest import StageOutput, compute_input_key
from storage.schemas import PROMPTS
from storage.tracking import Tracker

CODE = "c0de" * 16

METRIC_STEPS = 50
PARAMS = 150


def write_stage(root: str, stage: str, barrier) -> None:
    """Open the store and the campaign at the same moment as the other worker, then log a stage."""
    layout = RunLayout(Path(root))
    barrier.wait(timeout=120)
    tracker = Tracker(layout.tracking_uri(), artifact_root=layout.artifact_root())
    experiment_id = tracker.experiment_id("race")
    parent = tracker.start_run(experiment_id, name=f"iteration-{stage}", tags={"rlhf.kind": "iteration"})
    key = compute_input_key(stage, {"stage": stage}, {}, code=CODE)
    final_dir = layout.stage_dir(stage, key)
    with StageOutput(final_dir, stage=stage, input_key=key, config={"stage": stage}, upstream={}, code=CODE) as out:
        table = pa.table({"prompt_id": [1, 2], "prompt": [stage, stage], "messages": [[], []]}, schema=PROMPTS)
        out.write_table("prompts", table, schema=PROMPTS)
    run_id = tracker.start_run(experiment_id, name=stage, tags={"rlhf.kind": "stage"}, parent_run_id=parent)
    tracker.log_params(run_id, {f"p{i}": i for i in range(PARAMS)})
    for step in range(METRIC_STEPS):
        tracker.log_metrics(run_id, {f"{stage}/a": step, f"{stage}/b": -step}, step=step)
    tracker.log_stage_output(run_id, final_dir, out.manifest)
    tracker.end_run(run_id)
    tracker.end_run(parent)
