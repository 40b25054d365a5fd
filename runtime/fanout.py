"""Fan a generation stage's work out over shards of its prompts, on the Prefect task runner of ``execution``.

``sample_candidates``, ``rollout``, ``evaluate`` and labelling by a reward model split their items
(prompts, or candidate pairs) into shards and gather the shards' rows into their one output:

1. Shard boundaries depend only on the data and ``sizes.rows_per_shard`` (:func:`runtime.shards.plan_shards`),
   never on the number of workers, and each shard draws from its own generator seeded from
   ``(seed, stage, iteration, shard)`` (:mod:`runtime.seeds`). Sampling draws its uniforms on the CPU, so a
   shard's rows are the same wherever it runs.
2. Each shard writes its rows to ``<output>.partial/shards/shard-00003.parquet`` (written whole, then
   published); the stage then reads the pieces in shard order and writes its output and manifest as any
   stage does, atomically. So ``local``, ``dask`` and ``ray`` give byte-identical outputs, the runner is
   part of no input key, and a crashed stage resumes at its first unfinished shard (the pieces stay until
   the output is in place), unless its plan says why it cannot (``Shards.not_resumable``: an environment that
   declares itself non-deterministic, whose episodes a run after a crash would not play alike): then the pieces are
   computed again, and the manifest's runtime says how many and why (``sampled_again``).
3. ``local`` runs the shards in the stage's own process, one after another, loading the models once.
   ``dask`` and ``ray`` submit one Prefect task per shard to ``execution.address`` (a Dask scheduler or a Ray
   cluster; the flow starts a local one when none is given, see :mod:`runtime.cluster`), given the stage's job in
   its wire format (:func:`runtime.job.encode_job`); each task loads its models, sets torch's thread count (a
   worker never ran the stage's own setup) and writes its piece. Workers therefore need the run folder and the
   model and data files at the same paths.
4. A shard's failure fails the stage with the shard's error, after the other shards finished.
5. Shards that sample on the generation engine prove every weight swap first (:mod:`runtime.engine_probe`); each
   process's proved swaps come back with its shards, and the stage records them (the manifest's runtime
   ``engine_probe``, the metric ``engine_probe_gap``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from runtime.engine_probe import PROBE_RECORDS, probe_failures_named, record_metrics, recording
from runtime.job import Job, Shards, decode_job, encode_job
from runtime.shards import Shard
from storage.holds import hold
from storage.progress import partial_dir
from storage.schemas import TABLES
from storage.shards import read_piece, write_piece

if TYPE_CHECKING:
    from runtime.context import Execution

logger = logging.getLogger(__name__)

SHARDS_FOLDER = "shards"


def run_shards(job: Job, plan: Shards) -> pa.Table:
    """Run the stage's work over every shard of ``plan`` not yet written, where ``execution`` says, and gather the
    rows; record the engine swaps the shards proved (choice 5).

    Returns:
        The shards' rows, concatenated in shard order.
    """
    folder = partial_dir(job.out.final_dir) / SHARDS_FOLDER
    if plan.not_resumable is not None and (
        written := [p for p in map(partial(piece_path, folder), plan.shards) if p.exists()]
    ):
        logger.info(
            "%s: %d shards of an earlier run are computed again: %s", job.stage, len(written), plan.not_resumable
        )
        for piece in written:
            piece.unlink()
        job.out.runtime["sampled_again"] = {"shards": len(written), "why": plan.not_resumable}
    todo = tuple(shard for shard in plan.shards if not piece_path(folder, shard).exists())
    if len(todo) < len(plan.shards):
        done = len(plan.shards) - len(todo)
        logger.info("%s: %d of %d shards were already written; running the rest", job.stage, done, len(plan.shards))
    execution = job.context.execution
    probes: list[dict] = []
    if todo and execution.task_runner == "local":
        with probe_failures_named(job.stage):
            probes = write_pieces(replace(job, shards=todo), plan.table)
    elif todo:
        shard_task = task(name=f"{job.stage}-shard", cache_policy=NO_CACHE)(write_shipped_pieces)
        # a worker runs shard tasks on several threads at once and outlives the command: it keeps no models
        context = replace(job.context, execution=replace(execution, frozen_model_bytes=0))
        shipped = replace(job, context=context)
        with task_runner(execution) as runner, probe_failures_named(job.stage):
            futures = [
                runner.submit(shard_task, {"job": encode_job(shipped.shipped((shard,))), "table": plan.table})
                for shard in todo
            ]
            wait(futures)  # every shard ends before the stage does, failed or not: none keeps writing after it
            results = [future.result() for future in futures]  # raises the first failed shard's error
        job.out.runtime.update(results[0][0])  # where the first shard's models ran
        probes = [record for _, records in results for record in records]
    job.out.runtime.update(task_runner=execution.task_runner, shards=len(plan.shards))
    if probes:
        job.out.runtime[PROBE_RECORDS] = probes
        job.out.metrics.update(record_metrics(probes))
    schema = TABLES[plan.table]
    tables = [read_piece(piece_path(folder, shard), schema=schema) for shard in plan.shards]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def piece_path(folder: Path, shard: Shard) -> Path:
    return folder / f"shard-{shard.index:05d}.parquet"


def write_pieces(job: Job, table: str) -> list[dict]:
    """Compute ``job.shards`` with the stage's work in this process and write their pieces; returns the generation
    engine's swaps it proved (choice 5)."""
    torch.set_num_threads(job.context.execution.torch_threads)
    folder = partial_dir(job.out.final_dir) / SHARDS_FOLDER
    with recording() as probes:
        for shard, rows in zip(job.shards, job.declaration().work(job), strict=True):
            write_piece(piece_path(folder, shard), rows, schema=TABLES[table])
            hold(job.stage, "shard")  # a test may kill the stage here, a shard written and the next to come
    return probes


def write_shipped_pieces(job: str, table: str) -> tuple[dict[str, Any], list[dict]]:
    """:func:`write_pieces` of a job in its wire format (a shard task); returns where its models ran and the swaps
    it proved."""
    shipped = decode_job(job)
    probes = write_pieces(shipped, table)
    return shipped.out.runtime, probes


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
