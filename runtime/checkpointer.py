"""The checkpointer of the training stages: their trained models, the models' optimizers and the stage's
:class:`TrainingState`, prepared in every training process, saved together and restored together.

One process, or N under ``accelerate launch`` or Ray Train, each with every model whole (DDP) or 1/N of it
(``execution.sharding``: FSDP2, :func:`rlhf_core.distributed.shard_model`). Every process makes a
:class:`Checkpointer` and calls each of its methods at the same point (they are collective).

Choices:

1. A mid-stage checkpoint holds everything the stage needs to continue exactly: the trained weights and their
   optimizer states as one torch distributed checkpoint (DCP, :func:`storage.checkpoints.save_state`), each process
   writing the part it holds, and the :class:`TrainingState` as JSON beside it (readable without torch). Only
   trained parameters are in it (a LoRA model's adapters and heads): the frozen ones are read from the model's
   source again, as when the stage started.
2. Any number of processes restores it, sharded or not: ``get_state_dict`` and ``set_state_dict``
   (``torch.distributed.checkpoint.state_dict``) name every tensor by its parameter, so each process reads the part
   of each tensor it holds now. A sharded run resumes on 1 process, and a 1-process run on N.
3. The stage output stays plain ``save_pretrained`` folders whatever the launch: the weights are gathered on the main
   process (:func:`rlhf_core.distributed.full_state_dict`), which writes them. The optimizer states an output keeps
   for the next iteration to continue (:data:`OPTIMIZERS`, prunable) are a DCP checkpoint too, without weights or
   training state, so the next iteration continues them on any number of processes.
4. Optimizer hyperparameters (learning rate, betas, weight decay) come from the stage's settings, never from a
   checkpoint: only per-parameter states (moments, step counts) are saved, so a replay that changes a learning
   rate trains at it, and every value saved is a tensor.
5. A mid-stage checkpoint is taken after an epoch when the main process's throttle says so (broadcast, so every
   process agrees), into a folder every process names alike (:func:`storage.progress.shared_staging`), which the
   main process publishes once every process wrote its part.
6. The optimizer states the previous release kept in a policy output (``<model>_optimizer/``: ``optimizer.pt``, or
   one file per FSDP process) are read whole and loaded on any number of processes
   (:func:`storage.checkpoints.read_legacy_optimizer_state`): a campaign it finished continues.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlhf_core.distributed import full_state_dict, is_sharded, prepare, shard_model
from rlhf_core.loading import is_adapted, merged
from runtime.bars import stage_bar
from runtime.context import Execution
from runtime.metering import Throttle
from runtime.record import write_training_curve
from storage.checkpoints import is_checkpoint, load_state, read_legacy_optimizer_state, save_model, save_state
from storage.progress import latest_progress, save_progress, shared_staging

OPTIMIZERS = "optimizers"
"""The folder of an output that keeps its models' optimizer states for the next iteration (a DCP checkpoint)."""
TRAINING_STATE_FILE = "training_state.json"
"""The :class:`TrainingState` of a mid-stage checkpoint, beside its DCP files."""
LEGACY_OPTIMIZER_FOLDER = "{model}_optimizer"
"""Where the previous release kept a model's optimizer states in a policy output (choice 6)."""

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds a model's optimizer over its trained parameters, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-5)``."""
Progress = TypeVar("Progress", bound=tuple)

_TRAINED = StateDictOptions(ignore_frozen_params=True)
_TRAINED_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)  # the frozen ones are not in a checkpoint
_WHOLE = StateDictOptions(full_state_dict=True)


class TrainingState(NamedTuple):
    """What a training stage needs besides weights and optimizer states to continue exactly after a crash.

    Args:
        progress: the stage's progress after its last whole epoch (``PPOProgress``, ``RewardTrainingProgress``) as
            a dict.
        generator: the state of the stage's shuffling generator (``torch.Generator.get_state()`` as ints).
        curve: one row of statistics per optimizer step so far (the output's training curve).
        scaler: fp16's loss scaler's state (``GradScaler.state_dict()``: its scale and how many steps since it last
            grew), or None without one (fp32, bf16): restarted at its initial scale, a resumed fp16 stage would skip
            and scale other steps than the uninterrupted one.
    """

    progress: dict[str, Any]
    generator: list[int]
    curve: list[dict[str, float]]
    scaler: dict[str, Any] | None = None

    def write(self, folder: Path) -> None:
        """Write it into the checkpoint ``folder``."""
        (Path(folder) / TRAINING_STATE_FILE).write_text(json.dumps(self._asdict(), sort_keys=True))

    @classmethod
    def read(cls, folder: Path) -> TrainingState:
        """The state :meth:`write` wrote into ``folder``."""
        return cls(**json.loads((Path(folder) / TRAINING_STATE_FILE).read_text()))


class Checkpointer:
    """A training stage's trained models and optimizers in this process, and its training state: prepared
    (:meth:`prepare`), checkpointed after epochs (:meth:`end_epoch`), and written as the stage output
    (:meth:`save_output`). Use it as a context manager around the training loop: it shows the epochs done (a
    :func:`runtime.bars.stage_bar`, which a launched training process relays to the stage's process).

    Args:
        accelerator: this process's.
        execution: how the stage runs (``sharding``, ``checkpoint_seconds``).
        final_dir: the stage output's final folder; its mid-stage checkpoints live beside it.
        generator: the stage's shuffling generator, saved and restored with the checkpoint.
        epochs: the epochs the stage trains (none is checkpointed after the last: the output follows); for a stage
            that checkpoints after optimizer steps (:meth:`end_step`), the steps it takes.
        name: the stage's name, for the progress bar.
        unit: what ``epochs`` counts, for the progress bar: ``epoch``, or ``step`` for :meth:`end_step`.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        execution: Execution,
        final_dir: Path,
        *,
        generator: torch.Generator,
        epochs: int,
        name: str,
        unit: str = "epoch",
    ) -> None:
        self.accelerator = accelerator
        self.execution = execution
        self.final_dir = Path(final_dir)
        self.generator = generator
        self.epochs = epochs
        self.name = name
        self.unit = unit
        self.checkpoint = latest_progress(self.final_dir)
        """``(epochs_done, folder)`` of a crashed attempt's newest checkpoint, which :meth:`prepare` restores."""
        self.curve: list[dict[str, float]] = []
        self.resumed: TrainingState | None = None
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.throttle = Throttle(execution.checkpoint_seconds)
        self.bar: Any = None  # the epochs done, shown while training (the context manager)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def prepare(
        self,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, OptimizerFactory],
        *,
        continues: Path | None = None,
    ) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """Shard ``models`` (under ``execution.sharding``), build their optimizers (``optimizers[name]`` over the
        model's trained parameters), restore them, and prepare them (:func:`rlhf_core.distributed.prepare`).

        Restores the crashed attempt's newest checkpoint (weights, optimizer states and :class:`TrainingState`,
        the generator's state included) where there is one; else the optimizer states the output ``continues``
        keeps (a previous policy's, choice 3 or 6); else nothing (fresh optimizers).

        Returns:
            the prepared models and their optimizers, by name.
        """
        sharding = self.execution.sharding
        self.models = {name: shard_model(model, sharding) if sharding else model for name, model in models.items()}
        self.optimizers = {
            name: optimizers[name]([parameter for parameter in model.parameters() if parameter.requires_grad])
            for name, model in self.models.items()
        }
        if self.checkpoint is not None:
            folder = self.checkpoint[1]
            self._load(folder, weights=True)
            self.resumed = TrainingState.read(folder)
            self.generator.set_state(torch.tensor(self.resumed.generator, dtype=torch.uint8))
            self.curve = list(self.resumed.curve)
            if self.resumed.scaler is not None and self.accelerator.scaler is not None:
                self.accelerator.scaler.load_state_dict(self.resumed.scaler)
        elif continues is not None:
            self._continue(Path(continues))
        names = list(self.models)
        prepared, optimizers_prepared = prepare(
            self.accelerator, list(self.models.values()), list(self.optimizers.values())
        )
        return dict(zip(names, prepared, strict=True)), dict(zip(names, optimizers_prepared, strict=True))

    def resume(self, kind: Callable[..., Progress]) -> Progress | None:
        """The progress to continue from as the stage's ``kind`` (e.g. ``PPOProgress``), None for a fresh start."""
        return None if self.resumed is None else kind(**self.resumed.progress)

    def __enter__(self) -> Checkpointer:
        done = self.checkpoint[0] if self.checkpoint else 0
        self.bar = stage_bar(total=self.epochs, initial=done, desc=self.name, unit=self.unit, disable=not self.main)
        return self

    def __exit__(self, *error: object) -> None:
        self.bar.close()  # on an error too, so the error's line starts a line of its own

    def record_step(self, step: int, stats: Mapping[str, Any] | tuple) -> None:
        """After each optimizer step (the training loop's ``on_step``): a row of the training curve from ``stats``
        (a mapping or a NamedTuple of numbers; None values are left out)."""
        values = stats._asdict() if isinstance(stats, tuple) else stats
        self.curve.append({"step": step, **{name: float(value) for name, value in values.items() if value is not None}})

    def end_epoch(self, progress: NamedTuple) -> None:
        """After each whole epoch (the training loop's ``on_epoch_end``, with its progress): show it, and take a
        checkpoint when it is due (choice 5)."""
        self._passed(progress.epochs_done, progress)

    def end_step(self, progress: NamedTuple) -> None:
        """After each optimizer step of a stage that continues mid-epoch (its loop's ``on_step_end``, with a progress
        that counts ``steps_done``; the checkpointer made with ``epochs`` its steps, ``unit`` step): as
        :meth:`end_epoch`, a step for an epoch."""
        self._passed(progress.steps_done, progress)

    def _passed(self, done: int, progress: NamedTuple) -> None:
        """``done`` units of ``epochs`` are behind: show it, and checkpoint ``progress`` when it is due (choice 5)."""
        self.bar.update(1)
        due = self.main and done < self.epochs and self.throttle.due()
        if self.accelerator.num_processes > 1:
            due = broadcast(torch.tensor([float(due)], device=self.accelerator.device), from_process=0).item() != 0
        if not due:
            return
        staging = shared_staging(self.final_dir, done)
        if self.main:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed attempt's leftover
            staging.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self._save(staging, weights=True)
        if self.main:
            scaler = None if self.accelerator.scaler is None else self.accelerator.scaler.state_dict()
            state = TrainingState(progress._asdict(), self.generator.get_state().tolist(), self.curve, scaler)
            save_progress(self.final_dir, done, state.write, staging=staging)
        self.accelerator.wait_for_everyone()

    def save_output(self, folder: Path, *, tokenizer: Any, keep_optimizers: bool = False, whole: bool = False) -> None:
        """Write the stage output into ``folder``: each model as ``folder/<name>`` (``save_pretrained``, with
        ``tokenizer``, by the main process; gathered from every process where sharded), the training curve, and with
        ``keep_optimizers`` the optimizer states (``folder/optimizers``, each process its part) for the next
        iteration to continue. With ``whole``, a LoRA model's adapters are merged into its weights
        (:func:`rlhf_core.loading.merged`): a whole model that needs no base, such as a campaign's initial policy.

        Raises:
            ValueError: ``whole`` for a LoRA model sharded over the processes (its adapters are merged in one).
        """
        gathered = {name: full_state_dict(model) if is_sharded(model) else None for name, model in self.models.items()}
        if keep_optimizers:
            self._save(Path(folder) / OPTIMIZERS, weights=False)
        if whole and any(is_adapted(model) and is_sharded(model) for model in self.models.values()):
            raise ValueError("a sharded LoRA model cannot be merged into a whole one: train it on one process")
        if self.main:
            for name, model in self.models.items():
                saved = merged(model) if whole else model
                save_model(Path(folder) / name, saved, tokenizer, state_dict=gathered[name])
            write_training_curve(Path(folder), self.curve)
        self.accelerator.wait_for_everyone()  # every part is written before the main process publishes the folder

    def _state(self, optimizers: Mapping[str, dict[str, Any]], *, weights: bool) -> dict[str, dict[str, Any]]:
        """What a checkpoint holds (choices 1 and 4): ``{model: {"optimizer": per-parameter states, "weights": trained
        parameters}}``, each tensor named by its parameter and, sharded, this process's part of it; ``optimizers``
        are the models' ``get_optimizer_state_dict``."""
        state = {}
        for name, model in self.models.items():
            state[name] = {"optimizer": optimizers[name]["state"]}
            if weights:
                state[name]["weights"] = _trained_weights(model)
        return state

    def _optimizer_states(self) -> dict[str, dict[str, Any]]:
        return {name: get_optimizer_state_dict(model, self.optimizers[name]) for name, model in self.models.items()}

    def _save(self, folder: Path, *, weights: bool) -> None:
        save_state(folder, self._state(self._optimizer_states(), weights=weights))

    def _load(self, folder: Path, *, weights: bool) -> None:
        """Restore the models' optimizer states (and with ``weights`` their trained parameters) from the checkpoint
        in ``folder``; the hyperparameters stay the settings' (choice 4)."""
        optimizers = self._optimizer_states()
        state = self._state(optimizers, weights=weights)
        load_state(folder, state)
        for name, model in self.models.items():
            if weights:
                set_model_state_dict(model, state[name]["weights"], options=_TRAINED_LOAD)
            saved = {"state": state[name]["optimizer"], "param_groups": optimizers[name]["param_groups"]}
            set_optimizer_state_dict(model, self.optimizers[name], saved)

    def _continue(self, output: Path) -> None:
        """Restore the optimizer states the stage output ``output`` kept: a DCP checkpoint, or the previous release's
        files (choice 6)."""
        if is_checkpoint(output / OPTIMIZERS):
            self._load(output / OPTIMIZERS, weights=False)
            return
        for name, model in self.models.items():
            folder = output / LEGACY_OPTIMIZER_FOLDER.format(model=name)
            saved = read_legacy_optimizer_state(folder)
            if saved is None:
                raise FileNotFoundError(
                    f"{output} keeps no optimizer states for the {name} (neither {OPTIMIZERS}/ nor {folder.name}/)"
                )
            optimizer = self.optimizers[name]
            groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
            parameters = [fqn for group in groups for fqn in group["params"]]
            whole = {parameters[int(index)]: values for index, values in saved["state"].items()}
            set_optimizer_state_dict(model, optimizer, {"state": whole, "param_groups": groups}, options=_WHOLE)


def _trained_weights(model: nn.Module) -> dict[str, Any]:
    """``model``'s state without its frozen parameters, under any of their names: ``ignore_frozen_params`` leaves a
    frozen parameter in under its second name (GPT-2's output layer is its input embedding)."""
    frozen = {name for name, parameter in model.named_parameters(remove_duplicate=False) if not parameter.requires_grad}
    state = get_model_state_dict(model, options=_TRAINED)
    return {name: value for name, value in state.items() if name not in frozen}
