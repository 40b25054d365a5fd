"""How many torch threads a command's stages run on (``execution.torch_threads``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from rlhf_core.loading import count_parameters
from rlhf_core.precision import resolve_threads


@functools.cache
def _load_at_start() -> float:
    """The machine's 1-minute load average when this process first asked: every iteration of a command, and the
    generation engine it starts, then run on the same number of threads (its own stages would raise the load it
    reads later)."""
    return os.getloadavg()[0]


def command_threads(choice: int | str, policy: str | Path) -> int:
    """The torch threads ``execution.torch_threads`` (``choice``) gives this command for the policy in the folder
    ``policy`` on this machine (:func:`rlhf_core.precision.resolve_threads`)."""
    return resolve_threads(
        choice, parameters=count_parameters(policy), cores=len(os.sched_getaffinity(0)), load=_load_at_start()
    )
