"""``rlhf gc``: remove the stage outputs of a campaign that nothing kept needs.

What is kept:

1. every output of the newest ``keep_last`` finished iterations (a superseded run is none), and of every
   unfinished iteration (its resume needs them), plus the *inputs each of those outputs was computed from*
   (one level up: the previous policy and reward model an iteration started from, every preference
   table its reward model trained on), which is what replaying a kept iteration or continuing the
   campaign reads;
2. every output of a replay of a kept iteration, and of an unfinished replay;
3. the folder of every registered model version that is kept: versions made by kept iterations,
   and versions a person pinned with an alias of their own (any alias but MLflow's ``latest``);
   the other versions are deleted from the registry, since their folders go;
4. outputs no MLflow run records (a crash between writing and recording leaves one; the resume
   records it);
5. optimizer states only in the newest iteration's PPO output (as after every iteration);
6. every output of a stage that makes the campaign's base (:data:`BASE_STAGES`: the SFT model is the initial policy
   and reference whose weights every later policy's adapters and every reference forward read).

Everything else under the campaign folder is removed. MLflow keeps every run with its metrics;
a stage run whose output was removed can no longer be reused (the stage is computed again if
asked for), and is tagged ``rlhf.removed_by_gc`` before its folder goes: a rerun tells an output gc
removed from one that went missing otherwise, which it refuses (:mod:`campaign.verification`). The
campaign lock is held throughout, so no iteration runs meanwhile.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlparse

from campaign.config import PipelineConfig
from campaign.store import campaign_layout, store_tracker
from storage.locks import LockTimeout, exclusive_lock
from storage.manifest import Manifest, prune_files, read_manifest
from storage.mlflow_store import RunSummary
from storage.tracking import (
    KIND_ITERATION,
    KIND_REPLAY,
    KIND_STAGE,
    TAG_INPUT_KEY,
    TAG_KIND,
    TAG_OUTPUT_PREFIX,
    TAG_PARENT_RUN_ID,
    TAG_REMOVED_BY_GC,
    TAG_REPLAY_OF,
    TAG_STAGE,
    Tracker,
)

REGISTERED = ("actor", "critic", "reward-model")
"""Suffixes of the campaign's registered models (``<campaign>-actor``, ...)."""


@dataclass
class GcPlan:
    """What ``rlhf gc`` keeps and removes."""

    kept_iterations: list[int]
    remove: list[tuple[Path, int]] = field(default_factory=list)
    """Output folders to remove, with their size in bytes."""
    removed_runs: list[str] = field(default_factory=list)
    """The stage runs that recorded those folders (tagged ``rlhf.removed_by_gc`` before they go)."""
    versions: list[tuple[str, str]] = field(default_factory=list)
    """Registered model versions to delete: ``(name, version)``."""
    optimizer_states: list[Path] = field(default_factory=list)
    """PPO outputs whose optimizer states are pruned."""

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.remove)


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _output_folders(config: PipelineConfig) -> dict[Path, Manifest]:
    """Every finished stage output of the campaign, with its manifest."""
    root = campaign_layout(config).root
    folders = sorted(root.glob("*/*/_manifest.json")) if root.is_dir() else []
    return {path.parent: read_manifest(path.parent, verify=False) for path in folders}


def _stage_runs_of(tracker: Tracker, experiment_id: str, run: RunSummary) -> list[RunSummary]:
    """The stage runs whose outputs an iteration or replay run used: its own nested ones, and the reused
    ones its output tags name."""
    own = tracker.runs(experiment_id, tags={TAG_PARENT_RUN_ID: run.run_id})
    named = [run_id for key, run_id in run.tags.items() if key.startswith(TAG_OUTPUT_PREFIX) and run_id]
    return own + [tracker.run(run_id) for run_id in named]


BASE_STAGES = ("sft",)
"""Stages whose output is a base of the campaign's models (rule 6), kept whatever iterations are."""


def plan_gc(config: PipelineConfig, *, keep_last: int) -> GcPlan:
    """Decide what ``rlhf gc`` removes (see the module docstring); changes nothing.

    Raises:
        ValueError: ``keep_last`` is below 1.
        LookupError: the campaign does not exist.
    """
    if keep_last < 1:
        raise ValueError(
            f"`--keep-last` must be at least 1 (the newest iteration is what continuing needs), got {keep_last}"
        )
    tracker = store_tracker(config)
    if not tracker.has_experiment(config.campaign):
        raise LookupError(f"no campaign {config.campaign!r} in the MLflow store {tracker.tracking_uri}")
    experiment_id = tracker.experiment_id(config.campaign)
    layout = campaign_layout(config)
    outputs = _output_folders(config)
    by_digest = {manifest.digest: folder for folder, manifest in outputs.items()}

    finished = tracker.finished_iterations(experiment_id)
    kept_numbers = set(sorted(finished)[-keep_last:])
    unfinished = [r for r in tracker.runs(experiment_id, tags={TAG_KIND: KIND_ITERATION}) if r.status != "FINISHED"]
    kept_runs = [*unfinished, *(finished[number] for number in sorted(kept_numbers))]
    kept_ids = {run.run_id for run in kept_runs}
    replays = tracker.runs(experiment_id, tags={TAG_KIND: KIND_REPLAY})
    kept_runs += [run for run in replays if run.status != "FINISHED" or run.tags.get(TAG_REPLAY_OF) in kept_ids]

    def folder_of(stage_run: RunSummary) -> Path:
        return layout.stage_dir(stage_run.tags[TAG_STAGE], stage_run.tags[TAG_INPUT_KEY])

    used = {folder_of(stage) for run in kept_runs for stage in _stage_runs_of(tracker, experiment_id, run)}
    keep = used | {
        by_digest[d]
        for folder in used
        if folder in outputs
        for d in outputs[folder].upstream.values()
        if d in by_digest
    }

    plan = GcPlan(kept_iterations=sorted(kept_numbers))
    for suffix in REGISTERED:
        name = f"{config.campaign}-{suffix}"
        for version in tracker.model_versions(name):
            folder = _source_folder(version.source)
            pinned = [alias for alias in version.aliases if alias != "latest"]
            if folder is None or folder in keep or pinned:
                keep |= {folder} if folder is not None else set()
            else:
                plan.versions.append((name, version.version))

    keep |= {folder for folder, manifest in outputs.items() if manifest.stage in BASE_STAGES}
    recording = [run for run in tracker.runs(experiment_id, tags={TAG_KIND: KIND_STAGE}) if TAG_INPUT_KEY in run.tags]
    recorded = {folder_of(run) for run in recording}
    keep |= {folder for folder in outputs if folder not in recorded}
    plan.remove = [(folder, _size(folder)) for folder in sorted(outputs) if folder not in keep]
    removed = {folder for folder, _ in plan.remove}
    plan.removed_runs = [run.run_id for run in recording if folder_of(run) in removed]

    newest = finished[max(finished)] if finished else None
    newest_ppo = next(
        (
            folder_of(stage)
            for stage in (_stage_runs_of(tracker, experiment_id, newest) if newest else [])
            if stage.tags.get(TAG_STAGE) == "ppo_update"
        ),
        None,
    )
    plan.optimizer_states = [
        folder
        for folder in layout.stage_outputs("ppo_update")
        if folder != newest_ppo
        and folder in keep
        and any(e.prunable and (folder / e.path).exists() for e in outputs[folder].files)
    ]
    return plan


def _source_folder(source: str) -> Path | None:
    """The stage output folder a model version's source (``file://.../<stage>/<key>/<model>``) lies in."""
    parsed = urlparse(source)
    if parsed.scheme not in ("file", ""):
        return None  # an uploaded artifact: it lives in the tracking server's store, not here
    return Path(unquote(parsed.path)).parent


def collect_garbage(config: PipelineConfig, *, keep_last: int = 1, dry_run: bool = False) -> GcPlan:
    """Plan and (unless ``dry_run``) carry out ``rlhf gc`` under the campaign lock.

    Raises:
        LockTimeout: an iteration of the campaign is running.
    """
    lock = campaign_layout(config).lock_file()
    try:
        with exclusive_lock(lock, timeout=0):
            plan = plan_gc(config, keep_last=keep_last)
            if not dry_run:
                tracker = store_tracker(config)
                for name, version in plan.versions:
                    tracker.delete_model_version(name, version)
                when = datetime.now(UTC).isoformat(timespec="seconds")
                for run_id in plan.removed_runs:  # first: a crash between leaves folders a later gc removes
                    tracker.set_tags(run_id, {TAG_REMOVED_BY_GC: when})
                for folder, _ in plan.remove:
                    shutil.rmtree(folder)
                for folder in plan.optimizer_states:
                    prune_files(folder)
    except LockTimeout as error:
        raise LockTimeout(
            f"an iteration of campaign {config.campaign!r} is running ({lock} is locked): wait for it"
        ) from error
    return plan


def describe(plan: GcPlan, *, dry_run: bool) -> str:
    """A terminal report of a plan."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"kept iterations: {', '.join(map(str, plan.kept_iterations)) or 'none'}"]
    lines += [f"{verb} {folder.parent.name}/{folder.name} ({size / 2**20:.1f} MB)" for folder, size in plan.remove]
    lines += [f"{verb} model version {name} {version}" for name, version in plan.versions]
    lines += [f"{verb} optimizer states of ppo_update/{folder.name}" for folder in plan.optimizer_states]
    lines.append(f"{verb} {len(plan.remove)} stage outputs, {plan.bytes / 2**20:.1f} MB")
    return "\n".join(lines)
