"""The test run's one ``accelerate launch`` of 2 gloo processes, shared by the tests that compare 2 processes with 1.

Each launch pays for its processes' imports and process group before any training, so the training that
tests/rlhf_core/test_distributed.py (DDP and FSDP2) and tests/runtime/test_checkpointer.py (sharded checkpoints)
compare with one process is done in a single launch (tests/two_processes_job.py), once per test run: under
pytest-xdist the first worker to need it launches it while holding a lock, and the other reads its folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.once import built_once

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("two_processes_job.py")
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
LAUNCH += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


def launched_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The launch's folder: ``ddp/`` and ``fsdp/`` (tests/rlhf_core/distributed_job.py's cases on 2 processes,
    without and with sharding) and ``checkpointer/`` (tests/runtime/checkpointer_job.py's work, made ready in this
    process first). Launched by the first test that asks for it in this test run, on any xdist worker."""
    return built_once(tmp_path_factory, "two-processes", _launch)


def _launch(folder: Path) -> None:
    from tests.runtime.checkpointer_job import before_two_processes

    (folder / "checkpointer").mkdir()
    before_two_processes(folder / "checkpointer")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [*LAUNCH, str(JOB), str(folder)]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
