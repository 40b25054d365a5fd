"""Devices and numeric precision: the one place that says what ``device`` and ``precision`` mean.

Choices:
1. ``precision`` is ``fp32``, ``bf16`` or ``fp16``. Under ``bf16`` / ``fp16`` every forward pass
   runs inside ``torch.autocast`` with that dtype (matrix products in it, reductions and norms
   where autocast keeps them in fp32), as Accelerate's mixed precision does for training. Trained
   weights stay fp32 (the master copy the optimizer steps); frozen models are held in the
   precision's dtype, which halves their memory.
2. Log-probs, losses, values and scores are always cast to fp32 before any arithmetic on them
   (:func:`rlhf_core.sequences.logprobs_from_logits` and the model heads do it).
3. ``device`` (the setting ``execution.device``) is ``auto`` (CUDA when available), ``cpu`` or
   ``cuda``. Asking for CUDA where there is none is an error, never a silent fall-back to the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import get_args

import torch

from rlhf_core.config import DeviceChoice, Precision

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ACCELERATE_NAMES = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def check_precision(precision: str) -> Precision:
    """``precision`` itself, or a ValueError naming the allowed values."""
    if precision not in _DTYPES:
        raise ValueError(f"`precision` must be one of {get_args(Precision)}, got {precision!r}")
    return precision  # type: ignore[return-value]


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype matrix products run in (and frozen models are held in)."""
    return _DTYPES[check_precision(precision)]


def accelerate_mixed_precision(precision: Precision) -> str:
    """Accelerate's name for the precision: ``no``, ``bf16`` or ``fp16``."""
    return _ACCELERATE_NAMES[check_precision(precision)]


def resolve_device(choice: str) -> torch.device:
    """The device ``auto`` / ``cpu`` / ``cuda`` (or ``cuda:N``) names on this machine.

    Raises:
        ValueError: an unknown choice, or CUDA asked for where torch sees no GPU.
    """
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or choice.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"`execution.device` is {choice!r} but torch sees no CUDA device on this machine; use `auto` or `cpu`"
            )
        return torch.device(choice)
    raise ValueError(f"`execution.device` must be one of {get_args(DeviceChoice)}, got {choice!r}")


AUTO_THREADS_MIN_PARAMETERS = 20_000_000
"""From this many parameters up, ``execution.torch_threads: auto`` takes the idle cores; below, one thread: a small
model's matrix products are too short to pay for waking a second thread (``bench/torch_threads.py``)."""


def resolve_threads(choice: int | str, *, parameters: int, cores: int, load: float = 0.0) -> int:
    """The torch intra-op threads ``choice`` (a count, or ``auto``) names for a model of ``parameters``.

    ``auto`` gives one thread to a model under :data:`AUTO_THREADS_MIN_PARAMETERS`, and a larger one the ``cores``
    the machine's other work leaves idle (``cores`` less the whole part of the 1-minute ``load`` average, at least
    one): measured on
    2 cores, SmolLM2-135M samples and trains 1.7x faster on 2 threads than on 1 when they are idle, and about 20x
    slower when other processes keep them busy (a parallel region waits for both to be scheduled at once).

    Raises:
        ValueError: neither a positive count nor ``auto``.
    """
    if choice == "auto":
        return max(1, min(cores, cores - math.floor(load))) if parameters >= AUTO_THREADS_MIN_PARAMETERS else 1
    if isinstance(choice, int) and not isinstance(choice, bool) and choice > 0:
        return choice
    raise ValueError(f"`execution.torch_threads` must be a positive number or auto, got {choice!r}")


@contextmanager
def autocast(device: torch.device, precision: Precision) -> Iterator[None]:
    """Run the block's forward passes in ``precision`` (nothing changes for fp32).

    The same context Accelerate's mixed precision puts around a prepared model's forward, so a
    frozen model in a rollout and a trained one in the update compute alike.
    """
    if check_precision(precision) == "fp32":
        context = nullcontext()
    else:
        context = torch.autocast(device_type=device.type, dtype=_DTYPES[precision])
    with context:
        yield
