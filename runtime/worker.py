"""One training process of a training stage: ``python -m runtime.worker SPEC`` (see :mod:`runtime.launch`).

Every process runs the stage's ``work`` on the job of the spec (:func:`runtime.job.decode_job`); the work saves on
the main process only, and the main process writes the job's result (metrics and runtime) last, atomically.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import gather_object

from rlhf_core.precision import resolve_device
from runtime.context import Execution
from runtime.job import ERROR_PREFIX, RESULT_FILE, decode_job
from runtime.metering import PEAKS, peak_memory
from storage.files import write_text_replacing
from storage.holds import arm_from_environment


def main(argv: list[str] | None = None) -> None:
    (spec_path,) = sys.argv[1:] if argv is None else argv
    try:
        _run(Path(spec_path))
    except BaseException:
        # The worker's own error, whole, where the stage finds it (runtime.launch.worker_errors): in the workers'
        # log it can be lost among the other workers' output and the launcher's summary.
        rank = os.environ.get("RANK", "0")
        (Path(spec_path).parent / f"{ERROR_PREFIX}{rank}.txt").write_text(traceback.format_exc())
        raise


def ray_worker(config: dict[str, str]) -> None:
    """The job as a Ray Train worker's training function (:func:`runtime.launch.train` with Ray): Ray Train has
    formed the process group and set the variables accelerate reads (``RANK``, ``WORLD_SIZE``, ...)."""
    main([config["spec"]])


def _run(spec_path: Path) -> None:
    arm_from_environment()  # crash tests hold a training process too (storage.holds)
    job = decode_job(spec_path.read_text())
    execution = job.context.execution
    state = join_process_group(execution)
    with peak_memory(resolve_device(execution.device)) as peak:
        metrics = job.declaration().work(job)
        job.out.runtime[PEAKS] = gather_object([peak()])  # collective: every process's, in rank order
    if state.is_main_process:
        result = {"metrics": dict(metrics), "runtime": job.out.runtime}
        write_text_replacing(spec_path.with_name(RESULT_FILE), json.dumps(result))
    leave_process_group(state)


def leave_process_group(state: PartialState) -> None:
    """Leave the process group together: a worker that exits while another still holds the group can abort in
    native code ("terminate called without an active exception", SIGABRT), failing a stage that succeeded."""
    state.wait_for_everyone()
    state.destroy_process_group()


def join_process_group(execution: Execution) -> PartialState:
    """This worker's place among the launched processes, before any model is loaded.

    Accelerate's process state is a process-wide singleton fixed by its first creation, and without ``cpu=True``
    it sees no process group on a machine without GPUs: each worker would train alone on the whole batch. So the
    state is created here, first, for the stage's device (on GPUs this also makes the process's own GPU the
    current one, where `device: cuda` puts its models), and a worker that does not see every launched process
    fails at once rather than train alone.

    Raises:
        RuntimeError: the process group is not the ``execution.training_processes`` processes launched.
    """
    # Accelerate applies an FSDP config on GPUs only; the stages shard the models themselves, on any device
    # (execution.sharding), so accelerate must not wrap them a second time.
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    state = PartialState(cpu=resolve_device(execution.device).type == "cpu")
    if state.num_processes != execution.training_processes:
        raise RuntimeError(
            f"{execution.training_processes} training processes were launched, but this one sees a process group "
            f"of {state.num_processes} ({state.distributed_type}): it would train alone"
        )
    return state


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: with FSDP2's sharded modules alive, finalising them after the
    # process group was destroyed aborted a worker in native code now and then ("terminate called without an
    # active exception", SIGABRT) although its work was written. Everything is written and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
