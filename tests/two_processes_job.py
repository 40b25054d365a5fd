"""What the test run's 2 gloo processes do (tests/two_processes.py), under ``accelerate launch``.

``python two_processes_job.py FOLDER``: tests/rlhf_core/distributed_job.py's cases with DDP into ``FOLDER/ddp`` and
sharded (FSDP2) into ``FOLDER/fsdp``, then tests/runtime/checkpointer_job.py's sharded updates and reads in
``FOLDER/checkpointer`` (which its :func:`~tests.runtime.checkpointer_job.before_two_processes` made ready).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import PartialState

from runtime.worker import leave_process_group
from tests.rlhf_core.distributed_job import train_all
from tests.runtime.checkpointer_job import on_two_processes

if __name__ == "__main__":
    torch.set_num_threads(1)
    folder = Path(sys.argv[1])
    train_all(folder / "ddp", shard=False, sharded_cases=False)
    train_all(folder / "fsdp", shard=True, sharded_cases=True)
    on_two_processes(folder / "checkpointer")
    leave_process_group(PartialState())  # or a process may abort at exit, failing a run that succeeded
