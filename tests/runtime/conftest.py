"""What the runtime's tests share: a stage context on a fresh run root, with its SQLite MLflow store."""

from __future__ import annotations

from pathlib import Path

from runtime.context import BaseInputs, Execution, InputFile, StageContext, TrackingStore
from storage.layout import RunLayout

FILE = InputFile(path="/data/prompts.jsonl", sha256="a" * 64)


def stage_context(tmp_path: Path, *, policy: InputFile = FILE, execution: Execution | None = None) -> StageContext:
    """Iteration 0 of campaign ``camp`` (seed 0) under ``tmp_path``: every base input :data:`FILE`, but the policy and
    its tokenizer ``policy``; on one CPU thread unless ``execution`` says otherwise."""
    root = RunLayout(tmp_path)
    tracking = TrackingStore(uri=root.tracking_uri(), artifact_root=str(root.artifact_root()))
    return StageContext(
        layout=RunLayout(tmp_path / "camp"),
        tracking=tracking,
        campaign="camp",
        experiment_id=tracking.tracker().experiment_id("camp"),
        iteration=0,
        seed=0,
        base=BaseInputs(policy=policy, tokenizer=policy, prompts=FILE, eval_prompts=FILE),
        execution=execution or Execution(device="cpu", torch_threads=1),
        fingerprints=root.fingerprint_cache(),
    )
