"""The one mechanism that decides whether a stage runs or is reused, and the ``@stage`` task decorator.

A stage is reused if and only if an output with the same *input key* exists: in the run folder,
or recorded in MLflow (it is downloaded then). The input key is derived from exactly what the
stage receives, so what a stage reads and what decides its reuse cannot drift apart:

* its settings: the keyword-only arguments of the stage function (config slices, sizes, input
  files by content), plus the context's ``seed``, ``iteration`` and base-input fingerprint;
* its upstream outputs: the positional arguments after the context (``StageResult``, None, or a
  tuple of them), by manifest digest;
* its code: :func:`runtime.code.code_fingerprint` of the stage's module.

Every stage also records its wall time (``seconds``) and peak memory (``peak_memory_mb``: the
growth of the process's resident memory on CPU, ``max_memory_allocated`` on CUDA) as metrics, and
where it ran (device, threads, the models it loaded, the library versions: :mod:`runtime.versions`) in its
manifest's ``runtime``. A stage that launches training
processes also records each one's peak (``peak_memory_mb_rank<r>``), and ``peak_memory_mb`` is the largest.

Recording a stage in MLflow is idempotent: a stage run that an earlier attempt left unfinished (its
process was killed while copying artifacts, say) is finished in place, never recorded a second time
(:func:`_record_stage`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.states import Completed, State
from pydantic import BaseModel

from rlhf_core.config import LoraConfig
from rlhf_core.divergence import DivergenceError
from rlhf_core.errors import UserError
from rlhf_core.loading import ModelLoader
from rlhf_core.precision import Precision, resolve_device
from runtime.code import code_fingerprint
from runtime.context import InputFile, StageContext
from runtime.events import STAGE_EVENT
from runtime.versions import stage_versions
from storage.files import disk_errors
from storage.holds import hold
from storage.manifest import Manifest, StageOutput, compute_input_key, find_stage_output, read_manifest
from storage.progress import clear_progress
from storage.schemas import SAMPLES
from storage.tracking import (
    KIND_STAGE,
    TAG_CAMPAIGN,
    TAG_FLOW_RUN_ID,
    TAG_INPUT_KEY,
    TAG_ITERATION,
    TAG_KIND,
    TAG_STAGE,
    MissingOutputError,
    Tracker,
)

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


def setting_value(value: Any) -> Any:
    """A setting as plain JSON values for the input key: dataclasses and pydantic models as dicts,
    input files by content only, tuples as lists.

    Raises:
        TypeError: a value with no stable JSON form (a path: pass an :class:`InputFile`).
    """
    if isinstance(value, InputFile):
        return {"sha256": value.sha256}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: setting_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, BaseModel):
        return setting_value(value.model_dump(mode="python"))
    if isinstance(value, Mapping):
        return {str(key): setting_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [setting_value(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"a stage setting must be plain data, a dataclass, a pydantic model or an InputFile, got {value!r}")


def upstream_digests(upstream: Mapping[str, StageResult | tuple[StageResult, ...] | None]) -> dict[str, str]:
    """``name -> digest`` of every upstream output; a tuple ``name`` gives ``name_0``, ``name_1``, ..."""
    digests: dict[str, str] = {}
    for name, value in upstream.items():
        if isinstance(value, tuple | list):
            digests.update({f"{name}_{index}": result.digest for index, result in enumerate(value)})
        elif value is not None:
            digests[name] = value.digest
    return digests


def stage_state(result: StageResult) -> State:
    """The task's final state: ``Reused`` in the Prefect UI when nothing ran, else ``Completed``."""
    if result.reused:
        return Completed(data=result, name="Reused", message=f"reused {result.stage} output {result.input_key[:16]}")
    return Completed(data=result, message=f"wrote {result.stage} output {result.input_key[:16]}")


def stage(
    name: str, *, register: Mapping[str, str] | None = None
) -> Callable[[Callable[..., Mapping[str, float]]], Any]:
    """Make a Prefect task of a stage function ``f(out, context, *upstream, **settings) -> metrics``.

    The task takes ``(context, *upstream, **settings)``, derives the input key from exactly those
    arguments (see the module docstring), and calls ``f`` only when no output for the key exists.
    ``f`` writes into ``out.path`` (a :class:`storage.manifest.StageOutput`) and returns its
    summary metrics, unprefixed. The task's result is a :class:`StageResult` in a ``Completed``
    state (named ``Reused`` when nothing ran).

    Args:
        name: the stage: its folder, task name, MLflow child-run name and metric prefix.
        register: ``{registered model suffix: sub-folder}`` to register in MLflow with the new output.
    """

    def decorate(produce: Callable[..., Mapping[str, float]]) -> Any:
        parameters = list(inspect.signature(produce).parameters.values())
        if [p.name for p in parameters[:2]] != ["out", "context"]:
            raise TypeError(f"stage function {produce.__name__} must start with (out, context, ...)")
        task_signature = inspect.Signature(parameters[1:])
        upstream_names = [p.name for p in parameters[2:] if p.kind is not inspect.Parameter.KEYWORD_ONLY]

        @functools.wraps(produce)
        def run(*args: Any, **kwargs: Any) -> State:
            bound = task_signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            context: StageContext = arguments.pop("context")
            upstream = {key: arguments[key] for key in upstream_names}
            settings = {key: value for key, value in arguments.items() if key not in upstream}
            result = run_stage(
                context,
                name,
                settings=settings,
                upstream=upstream,
                code=code_fingerprint(produce.__module__),
                produce=lambda out: produce(out, context, **arguments),
                register=register,
            )
            return stage_state(result)

        run.__signature__ = task_signature.replace(return_annotation=State)  # type: ignore[attr-defined]
        return task(name=name, cache_policy=NO_CACHE)(run)

    return decorate


def run_stage(
    context: StageContext,
    stage: str,
    *,
    settings: Mapping[str, Any],
    upstream: Mapping[str, StageResult | tuple[StageResult, ...] | None],
    code: str,
    produce: Callable[[StageOutput], Mapping[str, float]],
    register: Mapping[str, str] | None = None,
) -> StageResult:
    """Reuse the stage's output for its input key if it exists anywhere, else produce it.

    Args:
        context: the iteration.
        stage: stage name: the folder, the MLflow child-run name and the metric prefix.
        settings: what the stage's result depends on besides its upstream outputs (see
            :func:`setting_value`); recorded as the stage run's params.
        upstream: named upstream outputs; their digests enter the input key.
        code: the fingerprint of the code that produces the output.
        produce: writes the output into ``out.path`` and returns summary metrics (unprefixed).
        register: ``{registered model suffix: sub-folder}`` to register in MLflow.
    """
    stage_settings = setting_value(settings)
    key_settings = {
        "stage": stage_settings,
        "context": {"seed": context.seed, "iteration": context.iteration, "base": context.base.fingerprint},
    }
    digests = upstream_digests(upstream)
    input_key = compute_input_key(stage, key_settings, digests, code=code)
    stage_dir = context.layout.stage_dir(stage, input_key)
    tracker = context.tracker
    record = tracker.find_stage_record(context.experiment_id, stage, input_key)

    manifest = find_stage_output(stage_dir, input_key)
    reused = manifest is not None
    if manifest is None and record is not None:
        logger.info("%s: fetching output %s recorded by MLflow run %s", stage, input_key[:16], record.run_id)
        try:
            tracker.download_stage_output(record.run_id, stage_dir)
            manifest, reused = read_manifest(stage_dir), True
        except MissingOutputError as error:
            logger.warning("%s: %s; computing it again", stage, error)
            record = None
    if manifest is None:
        _announce(f"{stage}: running (input key {input_key[:16]})", {STAGE_EVENT: "started", "rlhf_stage": stage})
        manifest = _produce(context, stage_dir, stage, input_key, key_settings, digests, code, produce)
        hold(stage, "output")
    else:
        logger.info("%s: reusing output %s", stage, input_key[:16])
    # Only once the output is in place (a crash before keeps the mid-stage progress), and on reuse too: a
    # crash between publishing the output and this line leaves progress nothing would read again.
    clear_progress(stage_dir)

    run_id = (
        record.run_id
        if record is not None
        else _record_stage(context, tracker, stage, stage_settings, manifest, stage_dir, register)
    )
    result = StageResult.of(stage_dir, manifest, reused=reused, run_id=run_id)
    _announce(describe_result(result), {STAGE_EVENT: "finished", "rlhf_result": result})
    return result


def _announce(message: str, extra: dict[str, Any]) -> None:
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


def _produce(
    context: StageContext,
    stage_dir: Path,
    stage: str,
    input_key: str,
    key_settings: dict[str, Any],
    digests: dict[str, str],
    code: str,
    produce: Callable[[StageOutput], Mapping[str, float]],
) -> Manifest:
    """Run ``produce`` into a new output, with the stage's threads, timing and peak memory."""
    execution = context.execution
    device = resolve_device(execution.device)
    # Every stage sets its own thread count: its numerics must not depend on what ran before it in the process.
    torch.set_num_threads(execution.torch_threads)
    started = time.perf_counter()
    try:
        with (
            _divergence_named(stage, context.iteration),
            StageOutput(
                stage_dir, stage=stage, input_key=input_key, config=key_settings, upstream=digests, code=code
            ) as out,
            peak_memory(device) as peak,
            disk_errors(stage_dir),  # inside: the temporary output is removed on the way out, freeing the disk
        ):
            out.runtime.update(device=str(device), torch_threads=execution.torch_threads, inputs=context.base.contents)
            out.runtime["versions"] = stage_versions(context, key_settings["stage"])
            if sources := context.base.sources:
                out.runtime["model_sources"] = sources
            out.metrics.update(produce(out))
            out.metrics["seconds"] = time.perf_counter() - started
            out.metrics.update(_peak_metrics(peak(), out.runtime.pop(PEAKS, [])))
            hold(stage, "computing")
    finally:
        _release_memory()
    return out.manifest


LEARNING_RATES = {
    "actor": "ppo.actor_learning_rate",
    "critic": "ppo.critic_learning_rate",
    "reward_model": "reward_model.learning_rate",
}
"""The setting that sets how fast each trained model moves: what to lower when it diverges."""


class Diverged(UserError, ValueError):
    """A stage found a model diverged (:class:`rlhf_core.divergence.DivergenceError`); the message (one line) names
    the stage, the iteration and the learning-rate setting to lower."""


@contextmanager
def _divergence_named(stage: str, iteration: int) -> Iterator[None]:
    """Name a divergence found inside the stage (outside its output, which is then never written)."""
    try:
        yield
    except DivergenceError as error:
        setting = LEARNING_RATES[error.model]
        when = "" if error.step is not None else " in an earlier update"
        raise Diverged(
            f"{stage}, iteration {iteration}: {error}{when}; lower `{setting}` (--set {setting}=...) and run again"
        ) from error


def stage_models(
    out: StageOutput, context: StageContext, precision: Precision, *, lora: LoraConfig | None = None
) -> ModelLoader:
    """The model seam for this stage: every model it loads is recorded in the output's ``runtime``.

    Args:
        lora: adapters for the models this stage trains from full weights (a stage continuing an
            adapter needs none: the folder says it holds one).
    """
    loader = context.execution.model_loader(precision, bases=context.base.bases, lora=lora)
    out.runtime.update(precision=precision, models=loader.loaded)
    return loader


def _release_memory() -> None:
    """Give the CUDA cache of a finished stage's models back before the next stage starts.

    The models themselves are freed by reference counting when the stage function returns (nothing
    keeps them in a cycle; ``tests/tasks/test_stage.py`` checks it), so no ``gc.collect()`` is
    needed: it would cost about 0.3 s per stage with torch, Prefect and MLflow loaded. The frozen
    models the process keeps for later stages (:data:`runtime.models.PROCESS_FROZEN_MODELS`) stay.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_STATUS_FIELD = re.compile(r"^(VmHWM|VmRSS):\s+(\d+) kB$", re.MULTILINE)


def _memory_status() -> dict[str, int] | None:
    """VmHWM and VmRSS of this process in kB, or None where /proc is unavailable."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return {name: int(value) for name, value in _STATUS_FIELD.findall(text)}


PEAKS = "peak_memory_mb_per_process"
"""Where a launched training job's processes report their peak memory (MiB, by rank) in the output's runtime."""


def _peak_metrics(own: float, processes: list[float]) -> dict[str, float]:
    """``peak_memory_mb``: the largest of this process's peak and those of the training processes it launched
    (each also as ``peak_memory_mb_rank<r>``)."""
    ranks = {f"peak_memory_mb_rank{rank}": peak for rank, peak in enumerate(processes)}
    return {"peak_memory_mb": max([own, *processes]), **ranks}


@contextmanager
def peak_memory(device: torch.device) -> Iterator[Callable[[], float]]:
    """Yield a function giving the block's peak memory so far, in MiB.

    CUDA: ``max_memory_allocated`` since the block began (frozen models kept from earlier stages
    included). CPU: the growth of the resident set's
    high-water mark over the resident set at the start (Linux resets the mark through
    ``/proc/self/clear_refs``); 0 where the system offers neither.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: torch.cuda.max_memory_allocated(device) / 2**20
        return
    start = _memory_status()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        start = None
    if start is None:
        yield lambda: 0.0
        return
    baseline = start.get("VmRSS", 0)

    def peak() -> float:
        now = _memory_status() or {}
        return max(now.get("VmHWM", baseline) - baseline, 0) / 1024

    yield peak


def _record_stage(
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
    if run_id is None:
        tags = {
            TAG_CAMPAIGN: context.campaign,
            TAG_ITERATION: str(context.iteration),
            TAG_STAGE: stage,
            TAG_KIND: KIND_STAGE,
            TAG_INPUT_KEY: manifest.input_key,  # from the start, so an interrupted record can be found
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
        tracker.log_metrics(run_id, metrics, step=context.iteration, skip_logged=True)
        curve = stage_dir / TRAINING_CURVE
        if curve.is_file():
            tracker.log_metric_steps(run_id, f"{stage}/train", json.loads(curve.read_text()))
        samples = stage_dir / SAMPLES
        if samples.is_file():
            rows = [json.loads(line) for line in samples.read_text().splitlines()]
            tracker.log_table(run_id, {name: [row.get(name) for row in rows] for name in rows[0]}, "samples.json")
        tracker.log_stage_output(run_id, stage_dir, manifest)
        hold(stage, "recording")
        for suffix, subfolder in (register or {}).items() if context.register_models else ():
            if (stage_dir / subfolder).is_dir():  # a critic-free update writes no critic to register
                tracker.register_model(
                    run_id, name=f"{context.campaign}-{suffix}", stage_dir=stage_dir, subfolder=subfolder
                )
        tracker.end_run(run_id)
    return run_id


TRAINING_CURVE = "training_curve.json"
"""A training stage's per-step statistics in its output: ``[{"step": 1, "loss": ...}, ...]``, logged in MLflow as
``<stage>/train/<name>`` at each step (:func:`_record_stage`), so the UI draws curves, not one point per stage."""


def write_training_curve(folder: Path, rows: list[dict[str, float]]) -> None:
    """Write ``rows`` (one per optimizer step, each with its ``step``) as the output's :data:`TRAINING_CURVE`."""
    (folder / TRAINING_CURVE).write_text(json.dumps(rows, sort_keys=True))  # the same text after a resume


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
