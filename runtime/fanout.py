"""Fan a generation stage's work out over shards of its prompts, on the Prefect task runner of ``execution``.

``sample_candidates``, ``rollout``, ``evaluate`` and labelling by a reward model split their items
(prompts, or candidate pairs) into shards and gather the shards' rows into their one output:

1. Shard boundaries depend only on the data and ``sizes.rows_per_shard`` (:func:`plan_shards`), never on
   the number of workers, and each shard draws from its own generator seeded from
   ``(seed, stage, iteration, shard)`` (:func:`shard_seed`). Sampling draws its uniforms on the CPU, so a
   shard's rows are the same wherever it runs.
2. Each shard writes its rows to ``<output>.partial/shards/shard-00003.parquet`` (written whole, then
   published); the stage then reads the pieces in shard order and writes its output and manifest as any
   stage does, atomically. So ``local``, ``dask`` and ``ray`` give byte-identical outputs, the runner is
   part of no input key, and a crashed stage resumes at its first unfinished shard (the pieces stay until
   the output is in place).
3. ``local`` runs the shards in the stage's own process, one after another, loading the models once.
   ``dask`` and ``ray`` submit one Prefect task per shard to ``execution.address`` (a Dask scheduler or a Ray
   cluster; the flow starts a local one when none is given, see :mod:`runtime.cluster`); each task loads its
   models, sets torch's thread count (a worker never ran the stage's own setup) and writes its piece.
   Workers therefore need the run folder and the model and data files at the same paths.
4. A shard's failure fails the stage with the shard's error, after the other shards finished.
5. Shards that sample on the generation engine prove every weight swap first (:mod:`runtime.engine_probe`); each
   process's proved swaps come back with its shards, and the stage records them (the manifest's runtime
   ``engine_probe``, the metric ``engine_probe_gap``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from rlhf_core.precision import Precision
from runtime.context import Execution, StageContext, stage_seed
from runtime.engine_probe import PROBE_RECORDS, probe_failures_named, record_metrics, recording
from storage.manifest import StageOutput
from storage.progress import partial_dir
from storage.shards import read_piece, write_piece

logger = logging.getLogger(__name__)

SHARDS_FOLDER = "shards"


@dataclass(frozen=True)
class Shard:
    """Items ``[start, stop)`` of a stage's work (prompts, or candidate pairs), and the seed of their generator."""

    index: int
    start: int
    stop: int
    seed: int

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with this shard's seed."""
        return torch.Generator().manual_seed(self.seed)

    def row_seeds(self, rows: range) -> list[int]:
        """One seed per output row (``rows``: their numbers in the stage's output), for a generation engine that
        seeds each request on its own: from ``(seed, stage, iteration, shard, row)``, so a row's tokens depend on
        no other row, nor on how rows are batched or where they run."""
        return [stage_seed(self.seed, "row", row) for row in rows]

    def batches(self, size: int) -> Iterator[slice]:
        """Consecutive slices of at most ``size`` items covering the shard, as indices into all items."""
        for start in range(self.start, self.stop, size):
            yield slice(start, min(start + size, self.stop))


ShardWork = Callable[..., Iterator[pa.Table]]
"""``work(models, context, shards, **arguments)`` yields one table per shard of ``shards``, in order."""


def shard_seed(seed: int, stage: str, iteration: int, shard: int) -> int:
    """A seed from the coordinates ``(seed, stage, iteration, shard)`` (:func:`runtime.context.stage_seed`)."""
    return stage_seed(seed, stage, iteration, f"shard-{shard}")


def plan_shards(
    items: int, *, rows_per_shard: int, rows_per_item: int, seed: int, stage: str, iteration: int
) -> list[Shard]:
    """Split ``items`` items, each giving ``rows_per_item`` rows, into shards of about ``rows_per_shard`` rows.

    A shard holds ``max(1, rows_per_shard // rows_per_item)`` whole items (a prompt's candidates or group
    never straddle two shards); the last holds the rest.

    Raises:
        ValueError: a count is not positive.
    """
    if rows_per_shard <= 0 or rows_per_item <= 0:
        raise ValueError(f"`rows_per_shard` and rows per item must be positive, got {rows_per_shard}, {rows_per_item}")
    per_shard = max(1, rows_per_shard // rows_per_item)
    return [
        Shard(index, start, min(start + per_shard, items), shard_seed(seed, stage, iteration, index))
        for index, start in enumerate(range(0, items, per_shard))
    ]


def run_shards(
    out: StageOutput,
    context: StageContext,
    stage: str,
    work: ShardWork,
    shards: list[Shard],
    *,
    schema: pa.Schema,
    precision: Precision,
    **arguments: Any,
) -> pa.Table:
    """Run ``work`` over every shard not yet written, where ``context.execution`` says, and gather the rows.

    Args:
        out: the stage's output; the pieces go to its ``.partial`` folder.
        stage: the stage name (the shard tasks' name).
        work: a module-level function (workers import it by name), see :data:`ShardWork`.
        shards: the plan (:func:`plan_shards`).
        schema: the schema of each shard's table.
        precision: the precision of the models ``work`` loads.
        arguments: ``work``'s other keyword arguments (plain data, stage results, config slices).

    Returns:
        The shards' rows, concatenated in shard order.
    """
    folder = partial_dir(out.final_dir) / SHARDS_FOLDER
    todo = [shard for shard in shards if not piece_path(folder, shard).exists()]
    if len(todo) < len(shards):
        logger.info(
            "%s: %d of %d shards were already written; running the rest", stage, len(shards) - len(todo), len(shards)
        )
    execution = context.execution
    runtime: list[dict] = []
    probes: list[dict] = []
    if todo and execution.task_runner == "local":
        with probe_failures_named(stage):
            runtime, probes = write_shards(
                folder, work, context, todo, schema=schema, precision=precision, arguments=arguments
            )
    elif todo:
        shard_task = task(name=f"{stage}-shard", cache_policy=NO_CACHE)(write_shards)
        # a worker runs shard tasks on several threads at once and outlives the command: it keeps no models
        worker_context = replace(context, execution=replace(execution, frozen_model_bytes=0))
        with task_runner(execution) as runner, probe_failures_named(stage):
            futures = [
                runner.submit(
                    shard_task,
                    {
                        "folder": folder,
                        "work": work,
                        "context": worker_context,
                        "shards": [shard],
                        "schema": schema,
                        "precision": precision,
                        "arguments": arguments,
                    },
                )
                for shard in todo
            ]
            wait(futures)  # every shard ends before the stage does, failed or not: none keeps writing after it
            results = [future.result() for future in futures]  # raises the first failed shard's error
        runtime = results[0][0]
        probes = [record for _, records in results for record in records]
    out.runtime.update(precision=precision, task_runner=execution.task_runner, shards=len(shards))
    if runtime:
        out.runtime["models"] = runtime
    if probes:
        out.runtime[PROBE_RECORDS] = probes
        out.metrics.update(record_metrics(probes))
    tables = [read_piece(piece_path(folder, shard), schema=schema) for shard in shards]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def piece_path(folder: Path, shard: Shard) -> Path:
    return folder / f"shard-{shard.index:05d}.parquet"


def write_shards(
    folder: Path,
    work: ShardWork,
    context: StageContext,
    shards: list[Shard],
    *,
    schema: pa.Schema,
    precision: Precision,
    arguments: dict[str, Any],
) -> tuple[list[dict], list[dict]]:
    """Compute ``shards`` with ``work`` in this process and write their pieces; returns the models it loaded and the
    generation engine's swaps it proved (choice 5)."""
    torch.set_num_threads(context.execution.torch_threads)
    models = context.execution.model_loader(precision, bases=context.base.bases)
    with recording() as probes:
        for shard, table in zip(shards, work(models, context, shards, **arguments), strict=True):
            write_piece(piece_path(folder, shard), table, schema=schema)
    return list(models.loaded), probes


def task_runner(execution: Execution) -> Any:
    """A Prefect task runner on ``execution.address`` (entered by the caller).

    Raises:
        ValueError: a Dask runner without an address (the flow starts a local cluster and sets one).
    """
    if execution.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        if execution.address is None:
            raise ValueError(
                "`execution.task_runner` dask needs `execution.address`: the flows start a local cluster and set it "
                "(runtime.cluster); a stage run on its own needs a running Dask scheduler"
            )
        return DaskTaskRunner(address=execution.address)
    if execution.task_runner == "ray":
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(address=execution.address)  # reuses the Ray instance the flow started, if any
    raise ValueError(f"`execution.task_runner` must be local, dask or ray, got {execution.task_runner!r}")
