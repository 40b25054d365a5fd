"""A training stage of its own process, forked from the command's warm server (issue 33; :mod:`runtime.warm`).

Real jobs of one CPU process (``execution.own_process``) run small training functions through
:func:`runtime.launch.train`, as an overlapped update does: each is a fork of one server, sees what a fresh process
would (the requester's environment now, its working directory, the stage's threads), fails the stage with its
own error, and ends with the command that asked for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime import warm
from runtime.context import BaseInputs, Execution, InputFile, StageContext, TrackingStore
from runtime.declaration import StageSettings, setting
from runtime.job import Job, JobOutput
from runtime.launch import TrainingWorkerError, train
from runtime.stage import Stage
from storage.layout import RunLayout
from tests.processes import running

REPO = Path(__file__).resolve().parents[2]
FILE = InputFile(path="/p", sha256="0" * 64)
VARIABLE = "RLHF_TEST_WARM_VALUE"


@dataclass(frozen=True)
class WarmSettings(StageSettings):
    stage = "warmed"
    which: str = setting("which")
    """The name of this module's function the job runs."""


def work(job: Job[WarmSettings]) -> dict[str, float]:
    return globals()[job.settings.which]()


warmed = Stage(WarmSettings, work=work)


def where_it_runs() -> dict[str, float]:
    """What the job sees of its process: its pid, its parent's, its threads, the requester's variable and folder."""
    import torch

    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "forked": float(Path(sys.argv[0]).name == "warm.py"),  # a fork of the server, not a fresh runtime.worker
        "threads": torch.get_num_threads(),
        "variable": float(os.environ.get(VARIABLE, "-1")),
        "in_repo": float(Path.cwd() == REPO),
    }


def fail() -> dict[str, float]:
    raise ValueError("the job could not read experience shard 3")


def die() -> dict[str, float]:
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def burn() -> dict[str, float]:
    """Spend a second and a half of CPU time; say where it ran (in ``$RLHF_TEST_WARM_PIDS``)."""
    Path(os.environ["RLHF_TEST_WARM_PIDS"]).write_text(f"{os.getpid()} {os.getppid()}")
    started = time.process_time()
    while time.process_time() - started < 1.5:
        pass
    return {}


def hold() -> dict[str, float]:
    """Say where it runs (in ``$RLHF_TEST_WARM_PIDS``), then wait to be killed."""
    Path(os.environ["RLHF_TEST_WARM_PIDS"]).write_text(f"{os.getpid()} {os.getppid()}")
    time.sleep(120)
    return {}


def _job(tmp_path: Path, which: str, *, threads: int = 1) -> Job[WarmSettings]:
    """A job of one CPU process of its own that runs ``which``."""
    out = JobOutput(path=tmp_path / which / "output.tmp", final_dir=tmp_path / which / "output")
    out.path.mkdir(parents=True)
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
        execution=Execution(device="cpu", own_process=True, torch_threads=threads),
    )
    return Job(__name__, context, WarmSettings(which=which), out)


def test_issue33_each_job_is_a_fork_of_one_server_and_sees_what_a_fresh_process_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv(VARIABLE, "1")
    first = train(_job(tmp_path / "a", "where_it_runs", threads=2), precision="fp32")
    monkeypatch.setenv(VARIABLE, "2")  # after the server started: the job takes the requester's environment now
    second = train(_job(tmp_path / "b", "where_it_runs", threads=1), precision="fp32")
    assert first["parent"] == second["parent"] == warm._server.pid  # one server, forked twice
    assert first["forked"] == second["forked"] == 1.0
    assert len({first["pid"], second["pid"], os.getpid()}) == 3
    assert (first["threads"], second["threads"]) == (2, 1)
    assert (first["variable"], second["variable"]) == (1.0, 2.0)
    assert first["in_repo"] == second["in_repo"] == 1.0


def test_issue33_a_failing_job_fails_the_stage_with_its_error_and_the_next_job_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(REPO)
    with pytest.raises(TrainingWorkerError, match="exit status 1") as failure:
        train(_job(tmp_path, "fail"), precision="fp32")
    assert "ValueError: the job could not read experience shard 3" in str(failure.value)
    with pytest.raises(TrainingWorkerError, match="exit status -9"):  # killed: the signal, as Popen says it
        train(_job(tmp_path, "die"), precision="fp32")
    assert train(_job(tmp_path, "where_it_runs"), precision="fp32")["parent"] == warm._server.pid


THREADED_SERVER = (
    "import threading, time; threading.Thread(target=time.sleep, args=(600,), daemon=True).start(); "
    "import runtime.warm as warm; warm.PRELOAD = (); warm.serve()"
)
"""The warm server with one more thread alive, as a library that started one at import would leave it (and nothing
preloaded: its job is a fresh process, which imports what it needs)."""


def test_issue42_a_server_with_another_thread_or_cuda_runs_its_job_as_a_fresh_process_not_a_fork(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A fork copies one thread: a lock another one held stays held in the child. The server forks only while it
    is its process's one thread (and has no CUDA context); else its job is a fresh worker, which sees the same."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv(VARIABLE, "3")
    if warm._server is not None:
        warm._stop(warm._server)
    monkeypatch.setattr(warm, "SERVER", [sys.executable, "-c", THREADED_SERVER])
    try:
        spawned = train(_job(tmp_path, "where_it_runs", threads=2), precision="fp32")
        assert spawned["parent"] == warm._server.pid and spawned["forked"] == 0.0
        assert (spawned["threads"], spawned["variable"], spawned["in_repo"]) == (2, 3.0, 1.0)
    finally:
        warm._stop(warm._server)
    assert warm._unforkable() is not None  # this test's own process: threads of its own (pytest's, Prefect's)


@pytest.mark.slow  # the crash step of .ci/run, with the other kill -9 tests
def test_issue33_kill_minus_nine_of_the_command_ends_its_server_and_its_job(tmp_path: Path):
    """The command's death ends the server (the parent-death signal), and the server's ends the job: nothing is
    left training (and writing) after ``kill -9``."""
    pids = tmp_path / "pids"
    program = (
        "import sys; from pathlib import Path; from tests.runtime.test_warm import _job; "
        "from runtime.launch import train; train(_job(Path(sys.argv[1]), 'hold'), precision='fp32')"
    )
    command = subprocess.Popen(
        [sys.executable, "-c", program, str(tmp_path)], cwd=REPO, env={**os.environ, "RLHF_TEST_WARM_PIDS": str(pids)}
    )
    deadline = time.monotonic() + 120
    while not pids.is_file() and command.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids.is_file(), "the job never started"
    job, server = map(int, pids.read_text().split())
    command.kill()
    command.wait()
    deadline = time.monotonic() + 20
    while (running(job) or running(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(job) and not running(server)


@pytest.mark.slow  # a command of its own and its warm server: the crash step of .ci/run, beside the kill -9 above
def test_issue33_a_commands_end_ends_its_server_and_counts_its_jobs_cpu_time_as_its_own(tmp_path: Path):
    """As a fresh training process's was: a benchmark reads a command's CPU seconds from its children's usage."""
    pids = tmp_path / "pids"
    program = (  # its first exit hook runs last: the server must have ended by then
        "import atexit, resource, sys; from pathlib import Path; from runtime import warm; "
        "atexit.register(lambda: print('ended', warm._server.poll() is not None)); "
        "from tests.runtime.test_warm import _job; from runtime.launch import train; "
        "train(_job(Path(sys.argv[1]), 'burn'), precision='fp32'); "
        "own = resource.getrusage(resource.RUSAGE_SELF); print(own.ru_utime + own.ru_stime)"
    )
    command = subprocess.Popen(
        [sys.executable, "-c", program, str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "RLHF_TEST_WARM_PIDS": str(pids)},
        stdout=subprocess.PIPE,
        text=True,
    )
    *_, own, ended = command.stdout.read().strip().splitlines()
    _, status, usage = os.wait4(command.pid, 0)
    command.returncode = os.waitstatus_to_exitcode(status)
    assert command.returncode == 0
    _, server = map(int, pids.read_text().split())
    assert ended == "ended True" and not running(server)
    # the job's CPU time, through the server the command waited for, beside the command's own
    assert usage.ru_utime + usage.ru_stime - float(own) >= 1.5
