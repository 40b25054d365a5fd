"""Training stages in N processes: ``accelerate launch`` workers, started and watched by the stage's task.

With ``execution.training_processes`` 1 and no ``execution.accelerate_config``, a training stage trains in
its own process. Otherwise :func:`train`:

1. writes the stage's job in its wire format (``<output>.partial/job/spec.json``, :func:`runtime.job.encode_job`)
   beside the stage's mid-epoch checkpoints;
2. runs ``accelerate launch --num_processes N -m runtime.worker SPEC`` (plus the accelerate config
   file, e.g. for the GPUs of a node), on a free port, its output going to ``job/workers.log``; or, with
   ``execution.training_launcher`` ray, N Ray Train workers placed on the Ray cluster at ``execution.address``
   (any of its machines), once the cluster has room for all of them (else a ``TimeoutError`` after
   ``execution.rendezvous_timeout``). Every worker first joins the process group and checks that it sees all N
   (:func:`runtime.worker.join_process_group`);
3. every worker reads the stage's inputs from disk and trains on its share of every minibatch
   (:mod:`rlhf_core.distributed`); the main process alone writes the output's files, mid-epoch
   checkpoints included, and ``job/result.json`` (metrics and runtime);
4. a worker's failure fails the task with that worker's traceback (each worker writes its own to
   ``job/error-<rank>.txt``) and the end of the workers' log;
5. with ``execution.own_process`` (``sampling.staleness`` >= 1: the stage's process samples the next iteration
   meanwhile) one process trains in a process of its own, :func:`runtime.worker.main` on the spec with no launcher,
   forked from the command's warm server (:mod:`runtime.warm`: its imports done once), as steps 1-4 say, and ends
   with the stage's process however that ends;
6. the main process's progress bar is shown by the stage's process while it waits (:mod:`runtime.bars`).

The stage's own process keeps the output (:class:`storage.manifest.StageOutput`): the manifest, the
atomic publication and the MLflow record are the same as for one process. A crashed launch leaves the
checkpoints; the next one resumes from them like one process would.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_core.precision import Precision, accelerate_mixed_precision
from runtime import warm
from runtime.bars import BAR_FILE_VARIABLE, relay_bar
from runtime.children import free_port, launch_tied
from runtime.job import ERROR_PREFIX, RESULT_FILE, SPEC_FILE, Job, encode_job
from storage.files import write_text_replacing
from storage.progress import partial_dir

if TYPE_CHECKING:
    from runtime.context import Execution

JOB_FOLDER = "job"
BAR_SECONDS = 0.5
"""How often the stage's process redraws a training process's progress bar."""
LOG_TAIL_LINES = 40
LAUNCHER_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
"""The last line of the launcher's traceback when a worker failed; its summary of the workers follows."""
WORKER_TRACEBACK_LINE = re.compile(r"\[rank\d+\]:")
"""How torch marks the lines of a worker's uncaught Python exception in the workers' log."""


class TrainingWorkerError(RuntimeError):
    """A training worker process failed; the message ends with the workers' last log lines."""


def train(job: Job, *, precision: Precision) -> dict[str, float]:
    """Run the stage's work in this process or in launched training processes; returns its metrics.

    Args:
        job: the stage's job; its work saves on the main process only and returns the stage's metrics.
        precision: the stage's precision (also the launch's mixed precision).

    Raises:
        TrainingWorkerError: a worker failed.
    """
    execution = job.context.execution
    on_ray = execution.training_launcher == "ray"
    alone = _alone(execution)
    if alone and not execution.own_process:
        return dict(job.declaration().work(job))
    ray_started = _join_ray(execution) if on_ray else False  # before any file: a cluster without room writes none
    folder = partial_dir(job.out.final_dir) / JOB_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    spec, log = folder / SPEC_FILE, folder / "workers.log"
    result = folder / RESULT_FILE
    result.unlink(missing_ok=True)
    for stale in folder.glob(f"{ERROR_PREFIX}*.txt"):  # a crashed launch's
        stale.unlink()
    write_text_replacing(spec, encode_job(job))
    if on_ray:
        status = _run_on_ray(spec, execution, log, started=ray_started)
    else:
        bar = folder / "bar.json"
        bar.unlink(missing_ok=True)
        environment = {**os.environ, "OMP_NUM_THREADS": str(execution.torch_threads), BAR_FILE_VARIABLE: str(bar)}
        if alone:  # one process of its own: the worker, forked warm, ended with this process (choice 5)
            status = warm.run(str(spec), log=str(log), environment=environment, relay=relay_bar(bar))
        else:
            command = [sys.executable, "-m", "accelerate.commands.launch", *launch_options(execution, precision)]
            command += ["-m", "runtime.worker", str(spec)]
            with open(log, "wb") as output:  # the launcher stops its workers when this process ends (SIGTERM)
                process = launch_tied(
                    sys.executable, command, own_group=False, stdout=output, stderr=subprocess.STDOUT, env=environment
                )
                status = _wait_showing(process, relay_bar(bar))
    if status != 0 or not result.is_file():
        raise TrainingWorkerError(
            f"{job.stage}: the {execution.training_processes} training processes failed (exit status "
            f"{status}){worker_errors(folder)}; the end of {log}:\n{_tail(log)}"
        )
    reported = json.loads(result.read_text())
    job.out.runtime.update(reported["runtime"])
    return reported["metrics"]


def _alone(execution: Execution) -> bool:
    """Whether a training stage trains in one process and without a launcher."""
    launched = execution.accelerate_config is not None or execution.training_launcher == "ray"
    return execution.training_processes == 1 and not launched


def warm_up(execution: Execution) -> None:
    """Start importing what a training process of its own needs (:func:`runtime.warm.prepare`) if the stages of
    ``execution`` train in one (choice 5), so that their first one starts warm."""
    if execution.own_process and _alone(execution):
        warm.prepare()


def _wait_showing(process: subprocess.Popen, relay: Callable[[bool], None]) -> int:
    """Wait for ``process``, showing its bar meanwhile (:func:`runtime.bars.relay_bar`); its exit status."""
    while process.poll() is None:
        relay(False)
        try:
            process.wait(timeout=BAR_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    relay(True)
    return process.returncode


def launch_options(execution: Execution, precision: Precision) -> list[str]:
    """``accelerate launch`` options: the config file if given, the process count, the precision, a free port."""
    options = []
    if execution.accelerate_config is not None:
        options += ["--config_file", execution.accelerate_config]  # its FSDP settings: execution.sharding
    elif execution.training_processes > 1:
        options += ["--multi_gpu"]  # DDP: NCCL on GPUs, gloo on CPUs
    if execution.training_processes > 1:
        options += ["--num_processes", str(execution.training_processes)]
    options += ["--num_machines", "1", "--mixed_precision", accelerate_mixed_precision(precision)]
    options += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    return options


def _worker_resources(execution: Execution) -> dict[str, float]:
    """What one Ray Train worker holds: a CPU, and a GPU where the models run on CUDA."""
    from rlhf_core.precision import resolve_device

    return {"CPU": 1.0, "GPU": 1.0} if resolve_device(execution.device).type == "cuda" else {"CPU": 1.0}


def _join_ray(execution: Execution) -> bool:
    """Connect to the Ray cluster at ``execution.address`` (a local Ray without one), unless this process already
    is, and wait until it has room for every training worker; returns whether this call connected.

    Raises:
        TimeoutError: no room for them within ``execution.rendezvous_timeout`` (a node that never joins).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    started = not ray.is_initialized()
    if started:
        local = {"num_cpus": execution.training_processes} if execution.address is None else {}
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
        ray.init(address=execution.address, **quiet, **local)
    processes, bundle = execution.training_processes, _worker_resources(execution)
    group = placement_group([bundle] * processes)
    ready = group.wait(timeout_seconds=execution.rendezvous_timeout)
    remove_placement_group(group)  # a probe: Ray Train reserves its own
    if not ready:
        where = f"the Ray cluster at {execution.address}" if execution.address else "the local Ray"
        offered = {name: ray.cluster_resources().get(name, 0) for name in bundle}
        if started:
            ray.shutdown()
        raise TimeoutError(
            f"`execution.training_processes` {processes} Ray Train workers ({bundle} each) found no room on "
            f"{where} (it has {offered}) within `execution.rendezvous_timeout` {execution.rendezvous_timeout:g} s: "
            "start the missing nodes, or train in fewer processes"
        )
    return started


def _run_on_ray(spec: Path, execution: Execution, log: Path, *, started: bool) -> int:
    """Run the job's workers as a Ray Train ``TorchTrainer`` (gloo on CPUs, NCCL on GPUs); their process group is
    Ray Train's, set up where Ray placed them. Returns 0, or 1 with the failure in ``log`` (each worker's own
    traceback is in its ``job/error-<rank>.txt``)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from runtime.worker import ray_worker

    resources = _worker_resources(execution)
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(execution.rendezvous_timeout)  # the controller's
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config={"spec": str(spec)},
        torch_config=TorchConfig(backend="nccl" if "GPU" in resources else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=execution.training_processes, use_gpu="GPU" in resources, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name="train",
            storage_path=str(spec.parent / "ray"),
            failure_config=FailureConfig(max_failures=0, controller_failure_limit=0),
            worker_runtime_env={"env_vars": {"OMP_NUM_THREADS": str(execution.torch_threads)}},
        ),
    )
    try:
        trainer.fit()
        return 0
    except Exception as error:  # Ray Train's failure wraps the worker's; each wrote its own traceback
        log.write_text(f"Ray Train: {type(error).__name__}: {error}\n")
        return 1
    finally:
        if started:
            ray.shutdown()


def worker_errors(folder: Path) -> str:
    """The tracebacks the failed workers wrote, by rank, as text for the error message ("" if none did)."""
    errors = sorted(folder.glob(f"{ERROR_PREFIX}*.txt"), key=lambda path: int(path.stem[len(ERROR_PREFIX) :]))
    return "".join(f"\nworker {path.stem[len(ERROR_PREFIX) :]}:\n{path.read_text().rstrip()}" for path in errors)


def _tail(log: Path) -> str:
    """The last lines of the workers' log that say something new: less the launcher's own traceback (the same
    for every failure) and the workers' Python tracebacks (``[rankN]:`` lines, whole in :func:`worker_errors`),
    which would push a worker's last words, e.g. before a native abort, out of the tail. The launcher's summary
    of exit codes and signals stays."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    end = next((i for i in range(len(lines) - 1, -1, -1) if LAUNCHER_FAILURE in lines[i]), None)
    if end is not None:  # the launcher's traceback: from its last "Traceback" line before that, through that
        start = max((i for i in range(end) if lines[i] == "Traceback (most recent call last):"), default=end)
        lines = lines[:start] + lines[end + 1 :]
    lines = [line for line in lines if not WORKER_TRACEBACK_LINE.match(line)]
    return "\n".join(lines[-LOG_TAIL_LINES:])
