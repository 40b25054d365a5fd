"""Checkpoints: Hugging Face ``save_pretrained`` folders, plus the state needed to resume training exactly.

Choices:

1. Weights are always safetensors in ``save_pretrained`` folders: HF causal LMs, and
   :class:`rlhf_core.models.Critic` / :class:`~rlhf_core.models.RewardModel`, which save their
   head beside the backbone. A tokenizer, when given, is saved into the same folder. Loading
   them is the model seam's job (:mod:`rlhf_core.loading`).
2. Optimizer and scheduler states are ``torch.save``d state dicts (plain tensors, numbers and
   lists), and every RNG state is encoded as tensors and ints, so that everything loads with
   ``torch.load(..., weights_only=True)``: nothing is ever unpickled from a checkpoint.
3. ``step`` and ``extra`` go into ``trainer_state.json``, so they can be read without torch.
4. The optimizer states of models sharded over N processes (FSDP) are saved sharded: each process writes its
   own shard, ``optimizer-<rank>-of-<N>.pt`` (:func:`save_optimizer_shard`), and reads it back on N processes
   again; states saved another way are refused in one line (:func:`check_optimizer_layout`).
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.errors import UserError
from rlhf_core.loading import save_model_folder

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pt"
TRAINER_STATE_FILE = "trainer_state.json"


def save_model(
    directory: Path,
    model: Any,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    weights: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save a model the model seam loaded (and optionally its tokenizer) as a folder of safetensors.

    Args:
        directory: the folder to write; created if missing.
        model: a causal LM, ``Critic`` or ``RewardModel`` from :class:`rlhf_core.loading.ModelLoader`.
        tokenizer: saved into the same folder when given.
        weights: save the backbone's weights; False when the model is its base unchanged (see
            :func:`rlhf_core.loading.save_model_folder`; a LoRA model saves only its adapter anyway).
        state_dict: the model's whole state, where ``model`` holds only this process's shard of it
            (:func:`rlhf_core.distributed.full_state_dict`).

    Returns:
        ``directory``.
    """
    directory = Path(directory)
    save_model_folder(model, directory, weights=weights, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _rng_state() -> dict[str, Any]:
    """Every RNG state as tensors, ints, floats and None (loadable with ``weights_only=True``)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python_version": version,
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_gauss_next": gauss_next,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state["numpy"] = {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype("int64")),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    internal = tuple(int(value) for value in state["python_state"].tolist())
    random.setstate((state["python_version"], internal, state["python_gauss_next"]))
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("the checkpoint holds CUDA RNG states but CUDA is unavailable; they are not restored")
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            logger.warning("the checkpoint holds a numpy RNG state but numpy is not installed")
            return
        saved = state["numpy"]
        keys = saved["keys"].numpy().astype("uint32")
        np.random.set_state((saved["kind"], keys, saved["position"], saved["has_gauss"], saved["cached_gaussian"]))


def save_training_state(
    directory: Path,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
) -> Path:
    """Save what training needs to continue exactly: optimizer, scheduler, RNG states, step.

    Args:
        directory: the folder to write; created if missing.
        optimizer: its ``state_dict()`` is saved when given.
        scheduler: an LR scheduler; its ``state_dict()`` is saved when given.
        step: the number of optimizer steps taken so far.
        extra: JSON-serialisable values to keep beside ``step`` (e.g. the KL controller's coefficient).
        rng: save the global RNG states (torch, python, numpy). Training whose only randomness is
            an explicit ``torch.Generator`` saves that instead and passes False, so the saved
            bytes do not depend on whatever else ran in the process before.

    Returns:
        ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    if scheduler is not None:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
    if rng:
        torch.save(_rng_state(), directory / RNG_FILE)
    trainer_state = {"step": int(step), "extra": dict(extra or {})}
    (directory / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
    return directory


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_training_state(
    directory: Path, *, optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None
) -> dict[str, Any]:
    """Restore what :func:`save_training_state` saved: states into ``optimizer`` / ``scheduler``, and the RNGs.

    Everything is read with ``torch.load(..., weights_only=True)``.

    Args:
        directory: a folder written by :func:`save_training_state`.
        optimizer: receives the saved optimizer state (the file must exist).
        scheduler: receives the saved scheduler state (the file must exist).

    Returns:
        ``{"step": int, "extra": dict}``.

    Raises:
        FileNotFoundError: a state asked for was not saved.
    """
    directory = Path(directory)
    for wanted, name in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        if wanted is not None and not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing")
    trainer_state = json.loads((directory / TRAINER_STATE_FILE).read_text())
    if optimizer is not None:
        optimizer.load_state_dict(_load(directory / OPTIMIZER_FILE))
    if scheduler is not None:
        scheduler.load_state_dict(_load(directory / SCHEDULER_FILE))
    if (directory / RNG_FILE).is_file():
        _set_rng_state(_load(directory / RNG_FILE))
    return {"step": int(trainer_state["step"]), "extra": dict(trainer_state["extra"])}


OPTIMIZER_SHARD = re.compile(r"optimizer-(\d{5})-of-(\d{5})\.pt")


class OptimizerLayoutError(UserError, ValueError):
    """Saved optimizer states cannot be loaded by this many training processes."""


def _shard_file(rank: int, processes: int) -> str:
    return f"optimizer-{rank:05d}-of-{processes:05d}.pt"


def save_optimizer_shard(directory: Path, state: dict[str, Any], *, rank: int, processes: int) -> Path:
    """Save this process's shard of an optimizer state (plain tensors: see
    :func:`rlhf_core.distributed.local_optimizer_state`) beside the ``trainer_state.json`` of
    :func:`save_training_state`; returns the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / _shard_file(rank, processes)
    torch.save(state, path)
    return path


def load_optimizer_shard(directory: Path, *, rank: int, processes: int) -> dict[str, Any]:
    """The shard :func:`save_optimizer_shard` saved for ``rank`` of ``processes``."""
    return _load(Path(directory) / _shard_file(rank, processes))


def optimizer_layout(directory: Path) -> int | None:
    """Over how many processes the optimizer state in ``directory`` is sharded: None for one whole state
    (``optimizer.pt``), 0 for none saved."""
    directory = Path(directory)
    if (directory / OPTIMIZER_FILE).is_file():
        return None
    counts = {
        int(match[2]) for path in directory.glob("optimizer-*.pt") if (match := OPTIMIZER_SHARD.fullmatch(path.name))
    }
    return counts.pop() if len(counts) == 1 else 0


def check_optimizer_layout(directory: Path, *, processes: int | None) -> None:
    """Refuse optimizer states that ``processes`` sharded processes (None: unsharded ones) cannot load.

    Raises:
        OptimizerLayoutError: the states were saved whole and are wanted sharded, or sharded over another number
            of processes, or sharded and wanted whole.
    """
    saved = optimizer_layout(directory)
    if saved == 0 or saved == processes:
        return
    how = "whole (unsharded training)" if saved is None else f"sharded over {saved} processes (FSDP)"
    wanted = f"{processes} sharded processes" if processes is not None else "unsharded training"
    raise OptimizerLayoutError(
        f"the optimizer states in {directory} were saved {how}, and {wanted} cannot load them: set "
        f"`execution.training_processes` (and `execution.accelerate_config`) as when they were saved"
    )
