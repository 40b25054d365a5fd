"""Training stages in N processes (issue 11): the workers form one process group, and a worker's failure fails
the stage with the worker's own error.

Real ``accelerate launch``es of 2 processes (gloo on the CPU) run small training functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.context import BaseInputs, Execution, InputFile, StageContext, TrackingStore
from runtime.declaration import StageSettings, setting
from runtime.job import Job, JobOutput
from runtime.launch import TrainingWorkerError, train
from runtime.stage import Stage
from storage.layout import RunLayout

FILE = InputFile(path="/p", sha256="0" * 64)


@dataclass(frozen=True)
class LaunchSettings(StageSettings):
    stage = "launched"
    which: str = setting("which")
    """The name of this module's function every training process runs."""


def work(job: Job[LaunchSettings]) -> dict[str, float]:
    return globals()[job.settings.which]()


launched = Stage(LaunchSettings, work=work)


def sum_the_ranks() -> dict[str, float]:
    """A training function that all-reduces ``rank + 1`` over the process group: 3 with 2 processes.

    The first process ends a second after the second: a process that left the group while another still held
    it would abort ("terminate called without an active exception", SIGABRT).
    """
    import time

    import torch
    from accelerate import PartialState

    state = PartialState()
    total = torch.tensor([state.process_index + 1.0])
    torch.distributed.all_reduce(total)
    if state.process_index == 0:
        time.sleep(1.0)
    return {"processes": state.num_processes, "rank_sum": total.item()}


def fail_in_the_second_process() -> dict[str, float]:
    """A training function whose second worker fails; the first ends normally."""
    from accelerate import PartialState

    if PartialState().process_index == 1:
        raise ValueError("worker 1 could not read experience shard 3")
    return {"loss": 0.0}


def abort_in_the_second_process() -> dict[str, float]:
    """A training function whose second worker dies in native code, leaving no Python traceback."""
    import os
    import sys

    from accelerate import PartialState

    if PartialState().process_index == 1:
        print("worker 1: native library failure", file=sys.stderr, flush=True)
        os.abort()
    return {"loss": 0.0}


def test_the_launched_workers_form_one_process_group_on_the_cpu(tmp_path: Path):
    """Accelerate sees no process group on a CPU unless asked: each worker would otherwise train alone."""
    metrics = train(_job(tmp_path, "sum_the_ranks"), precision="fp32")
    assert metrics == {"processes": 2, "rank_sum": 3.0}


def _job(tmp_path: Path, which: str) -> Job[LaunchSettings]:
    """A job of 2 CPU processes that run ``which``."""
    out = JobOutput(path=tmp_path / "output.tmp", final_dir=tmp_path / "output")
    out.path.mkdir()
    store = RunLayout(tmp_path / "store")
    base = BaseInputs(policy=FILE, tokenizer=FILE, prompts=FILE, eval_prompts=FILE)
    context = StageContext(
        layout=RunLayout(tmp_path / "campaign"),
        tracking=TrackingStore(uri=store.tracking_uri(), artifact_root=None),
        campaign="campaign",
        experiment_id="0",
        iteration=0,
        seed=0,
        base=base,
        execution=Execution(device="cpu", training_processes=2),
    )
    return Job(__name__, context, LaunchSettings(which=which), out)


def _failed_launch_message(tmp_path: Path, which: str) -> str:
    """The error of a 2-process launch of ``which`` that fails."""
    with pytest.raises(TrainingWorkerError, match="exit status") as failure:
        train(_job(tmp_path, which), precision="fp32")
    return str(failure.value)


@pytest.mark.slow  # another launch of 2 processes each: the sharded step of .ci/run
def test_a_failing_worker_fails_the_stage_with_its_error(tmp_path: Path):
    message = _failed_launch_message(tmp_path, "fail_in_the_second_process")
    assert "2 training processes failed" in message
    # the worker's own traceback, whole, however long the launcher's summary after it in the log
    assert "worker 1:\nTraceback (most recent call last):" in message
    assert "ValueError: worker 1 could not read experience shard 3" in message
    assert (tmp_path / "output.partial" / "job" / "workers.log").is_file()


@pytest.mark.slow  # another launch of 2 processes each: the sharded step of .ci/run
def test_a_worker_that_dies_without_a_traceback_fails_the_stage_with_its_last_words(tmp_path: Path):
    """The launcher's own traceback says nothing; the worker's output and the launcher's summary do."""
    message = _failed_launch_message(tmp_path, "abort_in_the_second_process")
    assert "worker 1: native library failure" in message
    assert "SIGABRT" in message
    assert "accelerate/commands/launch.py" not in message
