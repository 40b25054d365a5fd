"""Plumbing every stage task shares: the iteration context, stage seeds, tokenising prompts,
and :func:`run_stage`, the one mechanism that decides whether a stage runs or is reused.

A stage is reused if and only if an output with the same input key exists: in the run folder, or
recorded in MLflow (then it is downloaded). The input key hashes the stage's config slice and the
digests of its upstream outputs, so a change anywhere upstream re-runs everything below it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from prefect.states import Completed, State

from flows.config import PipelineConfig
from storage.layout import RunLayout
from storage.manifest import Manifest, StageOutput, compute_input_key, find_stage_output, read_manifest
from storage.tracking import Tracker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageResult:
    """A small reference to a finished stage output: what tasks pass each other (never tensors)."""

    stage: str
    path: str
    input_key: str
    digest: str
    reused: bool
    run_id: str | None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        return Path(self.path)

    @classmethod
    def of(cls, stage_dir: Path, manifest: Manifest, *, reused: bool, run_id: str | None) -> StageResult:
        """The reference to the verified output in ``stage_dir`` that ``manifest`` describes."""
        return cls(
            stage=manifest.stage,
            path=str(stage_dir),
            input_key=manifest.input_key,
            digest=manifest.digest,
            reused=reused,
            run_id=run_id,
            metrics=dict(manifest.metrics),
        )


@dataclass(frozen=True)
class BaseInputs:
    """The campaign's fixed inputs: the initial policy (also the frozen reference) and prompts."""

    policy_dir: str
    tokenizer_dir: str
    prompts_path: str
    eval_prompts_path: str
    fingerprint: str
    gold_available: bool


@dataclass(frozen=True)
class IterationContext:
    """Everything a stage task needs to know about where it runs."""

    config: PipelineConfig
    iteration: int
    base: BaseInputs
    experiment_id: str
    parent_run_id: str | None
    flow_run_id: str | None
    register_models: bool = True
    """Register new actor, critic and reward-model versions in MLflow (off for replays)."""

    @property
    def layout(self) -> RunLayout:
        return layout_for(self.config)

    def seed(self, stage: str) -> int:
        return stage_seed(self.config.seed, stage, self.iteration)

    def generator(self, stage: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed(stage))


def layout_for(config: PipelineConfig) -> RunLayout:
    return RunLayout(root=config.run_root / config.campaign)


def store_layout_for(config: PipelineConfig) -> RunLayout:
    """The layout of ``run_root`` itself: one MLflow store for every campaign under it."""
    return RunLayout(root=config.run_root)


def tracking_uri_for(config: PipelineConfig) -> str:
    return config.tracking_uri or store_layout_for(config).tracking_uri()


def tracker_of(config: PipelineConfig) -> Tracker:
    return tracker_for(tracking_uri_for(config), str(store_layout_for(config).artifact_root()))


@lru_cache(maxsize=4)
def tracker_for(tracking_uri: str, artifact_root: str) -> Tracker:
    """One Tracker per store and process (creating a client checks the database schema)."""
    return Tracker(tracking_uri, artifact_root=Path(artifact_root))


def context_tracker(context: IterationContext) -> Tracker:
    return tracker_of(context.config)


def stage_seed(seed: int, stage: str, iteration: int) -> int:
    """A seed from the coordinates ``(seed, stage, iteration)`` (nanochat-style), stable across runs."""
    digest = hashlib.sha256(f"{seed}/{stage}/{iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def accelerator_for(config: PipelineConfig) -> Accelerator:
    """An Accelerator on CUDA when there is one, else CPU; sets the torch thread count."""
    torch.set_num_threads(config.torch_threads)
    return Accelerator(cpu=not torch.cuda.is_available())


def stage_state(result: StageResult) -> State:
    """The task's final state: ``Reused`` in the Prefect UI when nothing ran, else ``Completed``."""
    if result.reused:
        return Completed(data=result, name="Reused", message=f"reused {result.stage} output {result.input_key[:16]}")
    return Completed(data=result, message=f"wrote {result.stage} output {result.input_key[:16]}")


def run_stage(
    context: IterationContext,
    stage: str,
    *,
    config: Mapping[str, Any],
    upstream: Mapping[str, StageResult | None],
    produce: Callable[[StageOutput], Mapping[str, float]],
    register: Mapping[str, str] | None = None,
) -> StageResult:
    """Reuse the stage's output for this input key if it exists anywhere, else produce it.

    Args:
        context: the iteration.
        stage: stage name: the folder, the MLflow child-run name and the metric prefix.
        config: the stage's config slice (JSON-able), part of the input key and logged as params.
        upstream: named upstream outputs; their digests enter the input key.
        produce: writes the output into ``out.path`` and returns summary metrics (unprefixed).
        register: ``{registered model suffix: sub-folder}`` to register in MLflow with alias ``latest``.
    """
    upstream_digests = {name: result.digest for name, result in upstream.items() if result is not None}
    key_config = {"stage_config": dict(config), "base": context.base.fingerprint}
    input_key = compute_input_key(stage, key_config, upstream_digests)
    stage_dir = context.layout.stage_dir(stage, input_key)
    tracker = context_tracker(context)
    record = tracker.find_stage_record(context.experiment_id, stage, input_key)

    manifest = find_stage_output(stage_dir, input_key)
    reused = manifest is not None
    if manifest is None and record is not None:
        logger.info("%s: downloading output %s from MLflow run %s", stage, input_key[:16], record.run_id)
        tracker.download_stage_output(record.run_id, stage_dir)
        manifest, reused = read_manifest(stage_dir), True
    if manifest is None:
        logger.info("%s: running (input key %s)", stage, input_key[:16])
        started = time.perf_counter()
        with StageOutput(
            stage_dir, stage=stage, input_key=input_key, config=key_config, upstream=upstream_digests
        ) as out:
            out.metrics.update(produce(out))
            out.metrics["seconds"] = time.perf_counter() - started
        manifest = out.manifest
    else:
        logger.info("%s: reusing output %s", stage, input_key[:16])

    run_id = (
        record.run_id
        if record is not None
        else _record_stage(context, tracker, stage, dict(config), manifest, stage_dir, register)
    )
    return StageResult.of(stage_dir, manifest, reused=reused, run_id=run_id)


def _record_stage(
    context: IterationContext,
    tracker: Tracker,
    stage: str,
    config: dict[str, Any],
    manifest: Manifest,
    stage_dir: Path,
    register: Mapping[str, str] | None,
) -> str:
    """Log a finished stage output as a nested MLflow run (params, metrics, artifacts, datasets, models)."""
    tags = {
        "rlhf.campaign": context.config.campaign,
        "rlhf.iteration": str(context.iteration),
        "rlhf.stage": stage,
        "rlhf.kind": "stage",
    }
    if context.flow_run_id:
        tags["prefect.flow_run_id"] = context.flow_run_id
    run_id = tracker.start_run(context.experiment_id, name=stage, tags=tags, parent_run_id=context.parent_run_id)
    tracker.log_params(run_id, config)
    tracker.log_metrics(
        run_id, {f"{stage}/{name}": value for name, value in manifest.metrics.items()}, step=context.iteration
    )
    tracker.log_stage_output(run_id, stage_dir, manifest)
    for suffix, subfolder in (register or {}).items() if context.register_models else ():
        tracker.register_model(
            run_id, name=f"{context.config.campaign}-{suffix}", artifact_subpath=f"output/{subfolder}"
        )
    tracker.end_run(run_id)
    return run_id


def recorded_result(context: IterationContext, run_id: str) -> StageResult:
    """The output of a stage run recorded in MLflow, downloaded into the run folder if it is not there."""
    tracker = context_tracker(context)
    tags = tracker.run_tags(run_id)
    stage, input_key = tags["rlhf.stage"], tags["rlhf.input_key"]
    stage_dir = context.layout.stage_dir(stage, input_key)
    manifest = find_stage_output(stage_dir, input_key)
    if manifest is None:
        tracker.download_stage_output(run_id, stage_dir)
        manifest = read_manifest(stage_dir)
    return StageResult.of(stage_dir, manifest, reused=True, run_id=run_id)


def upstream_result(context: IterationContext, result: StageResult, name: str) -> StageResult:
    """The recorded output that ``result`` names as its upstream ``name`` (found by manifest digest)."""
    digest = read_manifest(result.directory, verify=False).upstream[name]
    run_id = context_tracker(context).find_run(
        context.experiment_id, tags={"rlhf.manifest_digest": digest}, status="FINISHED"
    )
    if run_id is None:
        raise LookupError(f"no finished stage run in MLflow holds the {name!r} output {digest[:16]} of {result.stage}")
    return recorded_result(context, run_id)


class Throttle:
    """``due()`` is True at most once per ``seconds`` (every time for 0): paces mid-stage saves."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True
