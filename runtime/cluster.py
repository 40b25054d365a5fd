"""The cluster a generation stage fans its shards out to (``execution.task_runner`` dask or ray): an existing one
at ``execution.address``, or a local one started for the outermost flow that needs it.

Choices:
1. A local cluster (no ``execution.address``) lives as long as the outermost :func:`cluster` block: a campaign
   starts one for all its iterations, an iteration started alone starts its own; a block inside another uses the
   outer one. Its Dask address is found by :func:`cluster_address`, never written into the config. Ray is a
   per-process instance that stays initialised for the block.
2. Each stage connects its own Prefect task runner to that address (:func:`runtime.fanout.run_shards`), so a
   flow's own task runner stays Prefect's default and nothing below the flows depends on how the flow was started.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from runtime.execution import ExecutionConfig

logger = logging.getLogger(__name__)

_local_address: str | None = None
"""The address of the local Dask cluster the outermost :func:`cluster` block of this process started, if any."""


def cluster_address(execution: ExecutionConfig) -> str | None:
    """Where the shards of ``execution`` run: ``execution.address``, or the local Dask cluster a :func:`cluster` block
    started (None: this process, or the local Ray instance)."""
    return execution.address or _local_address


@contextmanager
def cluster(execution: ExecutionConfig) -> Iterator[None]:
    """Start the local cluster ``execution`` asks for (``task_runner`` dask or ray, no ``address``), unless one runs
    already, for the block."""
    global _local_address
    if execution.task_runner == "dask" and execution.address is None and _local_address is None:
        from distributed import LocalCluster

        # One thread per worker process: torch already parallelises inside a shard (torch_threads).
        with LocalCluster(
            n_workers=execution.workers, threads_per_worker=1, processes=True, dashboard_address=None
        ) as local:
            logger.info("started a local Dask cluster of %d workers at %s", execution.workers, local.scheduler_address)
            _local_address = local.scheduler_address
            try:
                yield
            finally:
                _local_address = None
        return
    if execution.task_runner == "ray":
        import ray

        if not ray.is_initialized():
            # "local" starts an instance of our own: with no address Ray joins a cluster `ray start` left running on
            # this machine (found through /tmp/ray), whose CPUs and lifetime are not ours.
            local = {"num_cpus": execution.workers} if execution.address is None else {}
            ray.init(address=execution.address or "local", include_dashboard=False, namespace="prefect", **local)
            try:
                yield
            finally:
                ray.shutdown()
            return
    yield
