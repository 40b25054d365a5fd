"""A stage, declared once (:class:`Stage`), and the one mechanism that decides whether it runs or is reused.

A stage module declares ``name = Stage(NameSettings, work=..., plan=..., gather=...)``:

* ``NameSettings`` (:mod:`tasks.settings`) says what the stage is given: its settings, each read from the config by
  its path, and its inputs, other stages' outputs (:mod:`runtime.declaration`);
* ``plan(job)`` runs once, in the stage's own process, before any work, and says how the work runs: ``None``
  (``work`` once, here), :class:`Shards` (``work`` over shards of the items, on the Prefect task runner of
  ``execution``, :mod:`runtime.fanout`; ``gather`` then writes the output from their rows) or :class:`Training`
  (``work`` in each of the training processes, :mod:`runtime.launch`);
* ``work(job)`` is the only worker signature (:class:`runtime.job.Job`), wherever it runs.

A flow calls the stage with its inputs: ``rollout(context, config, policy=..., reward_model=...)``. The stage is
reused if and only if an output with the same *input key* exists: in the run folder, or recorded in MLflow (it is
downloaded then). The key is derived from exactly what the stage is given, so what it reads and what decides its
reuse cannot drift apart: its settings; the context's ``seed``, ``iteration`` and base-input fingerprint; its
inputs, by digest; the code that computes it (:func:`runtime.code.code_fingerprint` of its module); and for a stage
that samples on the vLLM engine, the engine's identity (:func:`runtime.engine.engine_identity`).

Every stage records its wall time and peak memory as metrics (:mod:`runtime.metering`), and where it ran in its
manifest's ``runtime``: device, threads, the models it loaded and the library versions (:mod:`runtime.versions`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.states import State
from pydantic import BaseModel

from rlhf_core.divergence import DivergenceError
from rlhf_core.errors import UserError
from rlhf_core.precision import resolve_device
from runtime.assets import publish_output
from runtime.code import code_fingerprint
from runtime.context import InputFile, StageContext
from runtime.declaration import StageResult, StageSettings, input_digests, setting_values, settings_from
from runtime.engine import samples_on_engine
from runtime.events import ITERATION_EVENT, STAGE_EVENT
from runtime.job import Job, Shards, Training
from runtime.metering import PEAKS, peak_memory, peak_metrics, release_memory
from runtime.record import announce, describe_result, record_stage, stage_state
from runtime.versions import stage_versions
from storage.files import disk_errors
from storage.fingerprints import remember_written
from storage.holds import hold
from storage.manifest import Manifest, StageOutput, compute_input_key, find_stage_output, read_manifest
from storage.progress import clear_progress
from storage.tracking import MissingOutputError

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=StageSettings)


@dataclass(frozen=True)
class Stage(Generic[S]):
    """One stage (see the module docstring).

    Args:
        settings: what it is given (a :class:`runtime.declaration.StageSettings` subclass); its ``stage`` names it.
        work: ``work(job)``: the metrics (once, or per training process), or one table per shard of ``job.shards``.
        plan: ``plan(job)``: None, :class:`Shards` or :class:`Training`; left out: ``work`` once, here.
        gather: ``gather(job, rows)``: with :class:`Shards`, writes the output from every shard's rows, in order,
            and returns the metrics.
        register: ``{registered model suffix: sub-folder}`` to register in MLflow with a new output.
    """

    settings: type[S]
    work: Callable[[Job[S]], Any]
    plan: Callable[[Job[S]], Shards | Training | None] | None = None
    gather: Callable[[Job[S], pa.Table], Mapping[str, float]] | None = None
    register: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.settings.stage

    @property
    def module(self) -> str:
        """The module that declares the stage: its code is part of the key, and workers import it by name."""
        return self.work.__module__

    @functools.cached_property
    def task(self) -> Callable[[StageContext, S], State]:
        """The Prefect task that runs the stage: named after it, its result a :class:`StageResult` in a ``Completed``
        state (named ``Reused`` when nothing ran)."""

        def run(context: StageContext, settings: S) -> State:
            return stage_state(run_stage(self, context, settings))

        return task(name=self.name, cache_policy=NO_CACHE)(run)

    def __call__(self, context: StageContext, config: Any, **inputs: Any) -> StageResult:
        """Run (or reuse) the stage as a Prefect task, with its settings read from ``config`` and ``context.base`` and
        these inputs."""
        settings = settings_from(self.settings, config, context.base, inputs)
        return self.task(context, settings).result()

    def submit(self, context: StageContext, config: Any, **inputs: Any) -> PrefectFuture:
        """Start the stage as a Prefect task beside the flow's own work (on the flow's task runner, a thread); the
        future's ``result()`` is its :class:`StageResult`."""
        settings = settings_from(self.settings, config, context.base, inputs)
        return self.task.submit(context, settings)

    def run(self, context: StageContext, config: Any, **inputs: Any) -> StageResult:
        """The same as calling the stage, in this process with no Prefect task run (a test, a benchmark)."""
        return run_stage(self, context, settings_from(self.settings, config, context.base, inputs))


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


def run_stage(stage: Stage[S], context: StageContext, settings: S) -> StageResult:
    """Reuse the stage's output for its input key if it exists anywhere, else produce it (see the module docstring)."""
    name = stage.name
    stage_settings = setting_value(setting_values(settings))
    key_settings = {
        "stage": stage_settings,
        "context": {"seed": context.seed, "iteration": context.iteration, "base": context.base.fingerprint},
    }
    if samples_on_engine(settings):
        key_settings["engine"] = context.execution.engine
    digests = input_digests(settings)
    code = code_fingerprint(stage.module)
    input_key = compute_input_key(name, key_settings, digests, code=code)
    stage_dir = context.layout.stage_dir(name, input_key)
    tracker = context.tracker
    record = tracker.find_stage_record(context.experiment_id, name, input_key)

    manifest = find_stage_output(stage_dir, input_key)
    reused = manifest is not None
    if manifest is None and record is not None:
        logger.info("%s: fetching output %s recorded by MLflow run %s", name, input_key[:16], record.run_id)
        try:
            tracker.download_stage_output(record.run_id, stage_dir)
            manifest, reused = read_manifest(stage_dir), True
        except MissingOutputError as error:
            logger.warning("%s: %s; computing it again", name, error)
            record = None
    if manifest is None:
        announce(
            f"{name}: running (input key {input_key[:16]})",
            {STAGE_EVENT: "started", "rlhf_stage": name, ITERATION_EVENT: context.iteration},
        )
        out = StageOutput(stage_dir, stage=name, input_key=input_key, config=key_settings, upstream=digests, code=code)
        manifest = _produce(stage, Job(stage.module, context, settings, out))
        if context.fingerprints is not None:
            remember_written(context.fingerprints, stage_dir, ((entry.path, entry.sha256) for entry in manifest.files))
        hold(name, "output")
    else:
        logger.info("%s: reusing output %s", name, input_key[:16])
    # Only once the output is in place (a crash before keeps the mid-stage progress), and on reuse too: a
    # crash between publishing the output and this line leaves progress nothing would read again.
    clear_progress(stage_dir)

    run_id = None  # an output computed ahead of its iteration: recorded when its iteration calls the stage
    if record is not None:
        run_id = record.run_id
    elif context.records:
        run_id = record_stage(context, tracker, name, stage_settings, manifest, stage_dir, stage.register)
    result = StageResult.of(stage_dir, manifest, reused=reused, run_id=run_id)
    if context.records:  # an output computed ahead is materialised by the iteration that records it
        publish_output(context, result, settings, reused=record is not None)
    announce(
        describe_result(result),
        {STAGE_EVENT: "finished", "rlhf_result": result, ITERATION_EVENT: context.iteration},
    )
    return result


def _produce(stage: Stage[S], job: Job[S]) -> Manifest:
    """Write the stage's output as its plan says, with the stage's threads, timing and peak memory."""
    from runtime.fanout import run_shards
    from runtime.launch import train

    context, out = job.context, job.out
    execution = context.execution
    device = resolve_device(execution.device)
    # Every stage sets its own thread count: its numerics must not depend on what ran before it in the process.
    torch.set_num_threads(execution.torch_threads)
    started = time.perf_counter()
    try:
        with (
            _divergence_named(stage.name, context.iteration),
            out,
            peak_memory(device) as peak,
            disk_errors(out.final_dir),  # inside: the temporary output is removed on the way out, freeing the disk
        ):
            out.runtime.update(device=str(device), torch_threads=execution.torch_threads, inputs=context.base.contents)
            out.runtime["versions"] = stage_versions(context, on_engine=samples_on_engine(job.settings))
            if sources := context.base.sources:
                out.runtime["model_sources"] = sources
            plan = stage.plan(job) if stage.plan is not None else None
            if isinstance(plan, Shards):
                metrics = stage.gather(job, run_shards(job, plan))
            elif isinstance(plan, Training):
                metrics = train(job, precision=plan.precision)
            else:
                metrics = stage.work(job)
            out.metrics.update(metrics)
            out.metrics["seconds"] = time.perf_counter() - started
            out.metrics.update(peak_metrics(peak(), out.runtime.pop(PEAKS, [])))
            hold(stage.name, "computing")
    finally:
        release_memory()
    return out.manifest


LEARNING_RATES = {
    "actor": "ppo.actor_learning_rate",
    "critic": "ppo.critic_learning_rate",
    "reward_model": "reward_model.learning_rate",
}
"""The setting that sets how fast each trained model moves: what to lower when it diverges."""
STAGE_LEARNING_RATES = {("dpo_update", "actor"): "dpo.learning_rate"}
"""``(stage, model) -> setting`` where a stage trains a model at a rate of its own (:data:`LEARNING_RATES` elsewhere)."""


class Diverged(UserError, ValueError):
    """A stage found a model diverged (:class:`rlhf_core.divergence.DivergenceError`); the message (one line) names
    the stage, the iteration and the learning-rate setting to lower."""


@contextmanager
def _divergence_named(stage: str, iteration: int) -> Iterator[None]:
    """Name a divergence found inside the stage (outside its output, which is then never written)."""
    try:
        yield
    except DivergenceError as error:
        setting = STAGE_LEARNING_RATES.get((stage, error.model), LEARNING_RATES[error.model])
        when = "" if error.step is not None else " in an earlier update"
        raise Diverged(
            f"{stage}, iteration {iteration}: {error}{when}; lower `{setting}` (--set {setting}=...) and run again"
        ) from error
