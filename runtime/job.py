"""The one job a stage's work is given, and its one wire format, wherever the work runs.

A :class:`Job` is what :class:`runtime.stage.Stage`'s ``plan`` and ``work`` receive: the stage's context, its
settings (with its inputs, :mod:`runtime.declaration`), where it writes (its output's temporary and final
folders), and the shards it is to compute, if any. In the stage's own process it holds the
:class:`storage.manifest.StageOutput`; shipped elsewhere (a Dask or Ray shard task, an ``accelerate launch`` rank,
a Ray Train worker), it travels as JSON (:func:`encode`) and arrives with a :class:`JobOutput` in its place: the
same folders, and a runtime record sent back with the result.

Both sides import this module, so neither the launchers nor the workers import each other for it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rlhf_core.precision import Precision
from runtime.context import StageContext
from runtime.declaration import StageSettings
from runtime.seeds import round_coordinates, stage_seed

if TYPE_CHECKING:
    import torch

    from rlhf_core.config import LoraConfig
    from rlhf_core.loading import ModelLoader
    from runtime.shards import Shard
    from storage.manifest import StageOutput

S = TypeVar("S", bound=StageSettings)
ERROR_PREFIX = "error-"
"""A failed training process writes its traceback to ``job/error-<rank>.txt``."""
SPEC_FILE = "spec.json"
"""A training job's wire format, beside its processes' result and errors."""
RESULT_FILE = "result.json"
"""What a training job's main process reports: its metrics and runtime."""


@dataclass(frozen=True)
class Shards:
    """A plan: ``work`` computes the rows of these shards (of the table ``table`` of :data:`storage.schemas.TABLES`)
    wherever ``execution.task_runner`` runs them, and ``gather`` writes the output from all of them, in order."""

    shards: tuple[Shard, ...]
    table: str
    not_resumable: str | None = None
    """Why the shards a crashed run of the stage wrote must be computed again rather than reused (they are, and the
    manifest's runtime says so: ``sampled_again``); None: they are reused (:mod:`runtime.fanout`, choice 2)."""


@dataclass(frozen=True)
class Training:
    """A plan: ``work`` trains in this process or in the ``execution.training_processes`` launched ones, under
    ``precision`` (also the launch's mixed precision), and returns the stage's metrics."""

    precision: Precision


@dataclass
class JobOutput:
    """Where a job shipped to another process writes: the folders of the stage's :class:`StageOutput`.

    Args:
        path: the output's temporary folder (a training job's main process writes its files there).
        final_dir: the output's final folder (its ``.partial`` sibling holds mid-stage checkpoints and shards).
        runtime: where the models ran, sent back to the stage with the result.
    """

    path: Path
    final_dir: Path
    runtime: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Job(Generic[S]):
    """One stage's work (see the module docstring).

    Args:
        module: the module that declares the stage (``tasks.rollout``); a worker imports it by name.
        context: the iteration the stage belongs to.
        settings: the stage's settings and inputs.
        out: where it writes: the stage's :class:`StageOutput`, or a :class:`JobOutput` in another process.
        shards: the shards this job computes (a fan-out stage's work); empty otherwise.
    """

    module: str
    context: StageContext
    settings: S
    out: StageOutput | JobOutput
    shards: tuple[Shard, ...] = ()

    @property
    def stage(self) -> str:
        return self.settings.stage

    def declaration(self) -> Any:
        """The :class:`runtime.stage.Stage` this job belongs to, found by its module and name."""
        return getattr(importlib.import_module(self.module), self.stage)

    def models(self, precision: Precision, *, lora: LoraConfig | None = None) -> ModelLoader:
        """The model seam for this job (:class:`rlhf_core.loading.ModelLoader`); every model it loads is recorded in
        the output's runtime.

        Args:
            lora: adapters for the models this job trains from full weights (a stage continuing an adapter needs
                none: the folder says it holds one).
        """
        loader = self.context.execution.model_loader(precision, bases=self.context.base.bases, lora=lora)
        self.out.runtime.update(precision=precision, models=loader.loaded)
        return loader

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from ``(seed, stage, iteration)``."""
        return self.context.generator(self.stage)

    def seed(self, *, round_index: int = 0) -> int:
        """The stage's seed, ``(seed, stage, iteration)`` (:func:`runtime.seeds.stage_seed`), and ``round-R`` for a
        later round of the iteration's candidates (:func:`runtime.seeds.round_coordinates`)."""
        context = self.context
        return stage_seed(context.seed, self.stage, context.iteration, *round_coordinates(round_index))

    def plan_shards(
        self, items: int, *, rows_per_item: int, rows_per_shard: int, round_index: int = 0
    ) -> tuple[Shard, ...]:
        """This stage's ``items`` in shards of about ``rows_per_shard`` rows (:func:`runtime.shards.plan_shards`)."""
        from runtime.shards import plan_shards

        context = self.context
        return plan_shards(
            items,
            rows_per_shard=rows_per_shard,
            rows_per_item=rows_per_item,
            seed=context.seed,
            stage=self.stage,
            iteration=context.iteration,
            round_index=round_index,
        )

    def shipped(self, shards: tuple[Shard, ...] = ()) -> Job[S]:
        """This job as another process receives it: a :class:`JobOutput` for its output, and ``shards``."""
        return replace(self, out=JobOutput(path=self.out.path, final_dir=self.out.final_dir), shards=shards)


def encode_job(job: Job) -> str:
    """``job`` as JSON text (its output as a :class:`JobOutput`), for :func:`decode_job` in another process."""
    return json.dumps(encode(job.shipped(job.shards)))


def decode_job(text: str) -> Job:
    """The job :func:`encode_job` encoded."""
    return decode(json.loads(text))


def encode(value: Any) -> Any:
    """``value`` as JSON data that :func:`decode` turns back into an equal value: frozen dataclasses (by
    class name), paths, tuples, dicts and lists of them, and plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"__dataclass__": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    if isinstance(value, Path):
        return {"__path__": str(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(item) for item in value]}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, Mapping):
        return {"__dict__": {str(key): encode(item) for key, item in value.items()}}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"a job must be plain data, paths and dataclasses, got {value!r}")


def decode(value: Any) -> Any:
    """The value :func:`encode` encoded."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "__dataclass__" in value:
        kind = resolve(value["__dataclass__"])
        return kind(**{name: decode(item) for name, item in value["fields"].items()})
    if "__path__" in value:
        return Path(value["__path__"])
    if "__tuple__" in value:
        return tuple(decode(item) for item in value["__tuple__"])
    return {key: decode(item) for key, item in value["__dict__"].items()}


def resolve(name: str) -> Any:
    """The object named ``module:qualified.name``."""
    module, _, qualified = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualified.split("."):
        target = getattr(target, part)
    return target
