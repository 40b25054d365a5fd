"""The models a training stage trains, in each of its processes, sharded over them or not: preparing them, saving
them with their optimizer states, and restoring those states.

Unsharded (one process, or DDP): ``accelerator.prepare``, and the main process alone saves (every process holds
every weight). Sharded (``execution.sharding``: FSDP2, :func:`rlhf_core.distributed.shard_model`): each process
holds 1/N of every trained model's weights, gradients and optimizer states, so saving takes every process:

1. the weights are gathered on the main process (:func:`rlhf_core.distributed.full_state_dict`), which writes
   the same ``save_pretrained`` folders unsharded training writes: the stage output downstream stages and
   ``rlhf export`` read does not depend on how it was trained;
2. each process writes its own shard of the optimizer states (:func:`storage.checkpoints.save_optimizer_shard`),
   and reads it back when the stage resumes or the next iteration continues, on the same number of processes
   (other numbers are refused before any process starts: :func:`check_states`);
3. a mid-stage checkpoint is taken when the main process's throttle says so, by every process together, into a
   folder they all name alike (:func:`storage.progress.shared_staging`) that the main process then publishes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast
from torch import nn

from rlhf_core.distributed import (
    full_state_dict,
    load_local_optimizer_state,
    local_optimizer_state,
    prepare,
    shard_model,
)
from runtime.context import Execution
from storage.checkpoints import (
    check_optimizer_layout,
    load_optimizer_shard,
    load_training_state,
    save_model,
    save_optimizer_shard,
    save_training_state,
)
from storage.progress import save_progress, shared_staging


@dataclass
class Trained:
    """The trained models and their optimizers in this process, prepared (see the module docstring).

    Args:
        models: as :func:`rlhf_core.distributed.prepare` returned them.
        optimizers: one per model, in the same order.
        sharded: whether the models are sharded over the processes.
    """

    accelerator: Accelerator
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    sharded: bool

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def train_models(
    accelerator: Accelerator,
    execution: Execution,
    models: list[nn.Module],
    make_optimizer: Callable[[int, list[nn.Parameter]], torch.optim.Optimizer],
    states: list[Path | None],
) -> tuple[Trained, list[dict[str, Any]]]:
    """Shard ``models`` (under ``execution.sharding``), build their optimizers over their trained parameters
    (``make_optimizer(index, parameters)``), restore the optimizer states in ``states`` (a folder of
    :func:`save_training_state` per model, or None for a fresh one), and prepare them.

    Returns:
        the prepared models, and per model the ``{"step", "extra"}`` its restored state was saved with ({}
        for a fresh one).
    """
    sharded = execution.sharding is not None
    if sharded:
        models = [shard_model(model, execution.sharding) for model in models]
    optimizers = [
        make_optimizer(index, [parameter for parameter in model.parameters() if parameter.requires_grad])
        for index, model in enumerate(models)
    ]
    restored = []
    for optimizer, folder in zip(optimizers, states, strict=True):
        if folder is None:
            restored.append({})
        elif not sharded:
            restored.append(load_training_state(folder, optimizer=optimizer))
        else:
            restored.append(load_training_state(folder))
            shard = load_optimizer_shard(folder, rank=accelerator.process_index, processes=accelerator.num_processes)
            load_local_optimizer_state(optimizer, shard)
    models, optimizers = prepare(accelerator, models, optimizers)
    return Trained(accelerator, models, optimizers, sharded), restored


def save_trained(
    trained: Trained,
    folder: Path,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    tokenizer: Any,
    step: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save ``models`` (``folder/<name>``, ``save_pretrained``) and ``optimizers`` (``folder/<name>``, with
    ``step`` and ``extra``) as prepared by :func:`train_models`. Every process calls it: the main process writes
    the models and, unsharded, the optimizer states; sharded, every process gathers and writes its shard."""
    accelerator = trained.accelerator
    if not trained.sharded:
        if trained.main:
            for name, model in models.items():
                save_model(folder / name, accelerator.unwrap_model(model), tokenizer)
            for name, optimizer in optimizers.items():
                save_training_state(folder / name, optimizer=optimizer, step=step, extra=extra, rng=False)
        return
    states = {name: full_state_dict(model) for name, model in models.items()}  # collective
    rank, processes = accelerator.process_index, accelerator.num_processes
    for name, optimizer in optimizers.items():
        save_optimizer_shard(folder / name, local_optimizer_state(optimizer), rank=rank, processes=processes)
    if trained.main:
        for name, model in models.items():
            save_model(folder / name, model, tokenizer, state_dict=states[name])
        for name in optimizers:
            save_training_state(folder / name, step=step, extra=extra, rng=False)
    accelerator.wait_for_everyone()  # every shard is written before the main process publishes the folder


def save_checkpoint(
    trained: Trained, final_dir: Path, epochs_done: int, *, due: bool, write: Callable[[Path], None]
) -> None:
    """Save a mid-stage checkpoint with ``write(folder)`` (which calls :func:`save_trained`) when ``due`` on the
    main process: by the main process alone, or, sharded, by every process into a folder they share."""
    if not trained.sharded:
        if trained.main and due:
            save_progress(final_dir, epochs_done, write)
        return
    accelerator = trained.accelerator
    decided = broadcast(torch.tensor([float(due)], device=accelerator.device), from_process=0)
    if decided.item() == 0:
        return
    staging = shared_staging(final_dir, epochs_done)
    if trained.main:
        _empty(staging)
    accelerator.wait_for_everyone()
    write(staging)
    if trained.main:
        save_progress(final_dir, epochs_done, lambda folder: None, staging=staging)
    accelerator.wait_for_everyone()


def _empty(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def check_states(execution: Execution, folders: list[Path]) -> None:
    """Refuse, before any training process starts, optimizer states in ``folders`` that the stage's processes
    cannot load (:func:`storage.checkpoints.check_optimizer_layout`)."""
    processes = execution.training_processes if execution.sharding is not None else None
    for folder in folders:
        if folder.is_dir():
            check_optimizer_layout(folder, processes=processes)
