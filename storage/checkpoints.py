"""Checkpoints: Hugging Face ``save_pretrained`` folders, and the training state a stage resumes from.

Choices:

1. Weights are always safetensors in ``save_pretrained`` folders: HF causal LMs, and
   :class:`rlhf_core.models.Critic` / :class:`~rlhf_core.models.RewardModel`, which save their
   head beside the backbone. A tokenizer, when given, is saved into the same folder. Loading
   them is the model seam's job (:mod:`rlhf_core.loading`).
2. Training state (optimizer states, and a stage's trained weights between epochs) is a torch distributed
   checkpoint (DCP, ``torch.distributed.checkpoint``): a folder of ``.metadata`` and one ``__<rank>_0.distcp`` file
   per process that wrote it. Every process writes the part it holds (:func:`save_state`), and any number of
   processes reads it back, each the part it holds then (:func:`load_state`): it is named by tensor, not by process.
3. Its bytes depend only on what it holds: DCP's metadata would also record the folder and a random save id, which
   :class:`_Writer` leaves out, so a state written twice alike is the same files, and their digest can be part of an
   input key (the next PPO update's).
4. Nothing is unpickled from it but DCP's own records. Every value in it is a tensor (anything else is refused when
   saving), read with ``torch.load(..., weights_only=True)``; the metadata is read by an unpickler that admits DCP's
   metadata classes, sizes, dtypes and layouts only (:class:`_MetadataUnpickler`).
5. What the previous release saved (one ``optimizer.pt``, or ``optimizer-<rank>-of-<N>.pt`` per FSDP process) is
   read as one whole state (:func:`read_legacy_optimizer_state`), so a campaign it finished continues on any number
   of processes.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from transformers import PreTrainedTokenizerBase

from rlhf_core.loading import save_model_folder

CHECKPOINT_METADATA = ".metadata"
"""The file DCP writes last, when every process has written its part: a folder with it holds a whole checkpoint."""

OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_SHARD = re.compile(r"optimizer-(\d{5})-of-(\d{5})\.pt")
"""The previous release's optimizer states: whole, or one file per FSDP process."""


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


def is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint of :func:`save_state`."""
    return (Path(folder) / CHECKPOINT_METADATA).is_file()


def save_state(folder: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` (nested dicts of tensors, plain or ``DTensor`` shards) as a DCP checkpoint into ``folder``.

    Every training process calls it together (collective), each with its own part of the same state; a plain
    tensor every process holds alike is written once.

    Raises:
        TypeError: a value in ``state`` is not a tensor (it would be pickled).
    """
    _refuse_non_tensors(state, "")
    with _one_process_meant():
        dcp.save(dict(state), storage_writer=_Writer(Path(folder)), no_dist=not _distributed())


def load_state(folder: Path, state: Mapping[str, Any]) -> None:
    """Read the DCP checkpoint in ``folder`` into the tensors of ``state``, in place: each process reads the part of
    every tensor it holds, whatever number of processes saved them. Every key of ``state`` must be in the checkpoint;
    the checkpoint may hold more. Every training process calls it together (collective).

    Raises:
        FileNotFoundError: ``folder`` holds no whole checkpoint.
        pickle.UnpicklingError: the checkpoint's metadata holds something this pipeline never writes there.
    """
    _read_metadata(Path(folder) / CHECKPOINT_METADATA)  # refused here in one line, not inside DCP's collective
    with _one_process_meant():
        dcp.load(dict(state), storage_reader=_Reader(Path(folder)), no_dist=not _distributed())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _one_process_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what a stage in its own process means.
    DCP wraps each process's error in a ``CheckpointException`` (a ``BaseException``): the first process's own error
    is raised instead (an ``OSError`` first), so a full disk reaches :func:`storage.files.disk_errors` as what it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            yield
        except CheckpointException as wrapped:
            errors = [error for error, _ in wrapped.failures.values()]
            if not errors:
                raise
            raise next((error for error in errors if isinstance(error, OSError)), errors[0]) from wrapped


def _refuse_non_tensors(state: Mapping[str, Any], prefix: str) -> None:
    for key, value in state.items():
        if isinstance(value, Mapping):
            _refuse_non_tensors(value, f"{prefix}{key}.")
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"a checkpoint holds tensors only; {prefix}{key} is {type(value).__name__}")


class _Writer(FileSystemWriter):
    """DCP's file writer, without the folder and the random save id in the metadata (choice 3)."""

    def storage_meta(self) -> StorageMeta | None:
        return None


class _Reader(FileSystemReader):
    """DCP's file reader, whose metadata is read by :class:`_MetadataUnpickler` (choice 4)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.folder = folder

    def read_metadata(self, *args: Any, rank: int | None = None, **kwargs: Any) -> Metadata:
        name = CHECKPOINT_METADATA if rank is None else f"__{rank}{CHECKPOINT_METADATA}"  # per process: never written
        metadata = _read_metadata(self.folder / name)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata


def _read_metadata(path: Path) -> Metadata:
    with open(path, "rb") as file:
        metadata = _MetadataUnpickler(file, path).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds no checkpoint metadata")
    return metadata


_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_LAYOUT = ("torch.serialization", "_get_layout")
"""How DCP pickles a layout: by its name, looked up by this function."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata records (dataclasses and enums of ``torch.distributed.checkpoint``),
    ``torch.Size``, dtypes and layouts, and refuses every other name before importing anything."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or module == "torch" or (module, name) == _LAYOUT:
            found = super().find_class(module, name)
            if module == "torch":
                admitted = found is torch.Size or isinstance(found, _TORCH_VALUES)
            elif (module, name) == _LAYOUT:
                admitted = True
            else:
                admitted = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
            if admitted:
                return found
        raise pickle.UnpicklingError(
            f"{self.path} names {module}.{name}, which no checkpoint of this pipeline holds: it was not written by it"
        )


def read_legacy_optimizer_state(folder: Path) -> dict[str, Any] | None:
    """The whole optimizer state the previous release saved in ``folder`` (``optimizer.state_dict()``: parameters by
    index, in the optimizer's order), or None where it saved none.

    ``optimizer.pt`` is that state. FSDP shards (``optimizer-<rank>-of-<N>.pt``, each process's part of every tensor)
    are joined along the first dimension, where FSDP2 splits a tensor as ``torch.chunk`` does; scalars (``step``) are
    the same in every shard. Read with ``torch.load(..., weights_only=True)``.

    Raises:
        FileNotFoundError: a shard is missing.
    """
    folder = Path(folder)
    if (folder / OPTIMIZER_FILE).is_file():
        return _load(folder / OPTIMIZER_FILE)
    found = {
        int(match[1]): (int(match[2]), path)
        for path in folder.glob("optimizer-*.pt")
        if (match := OPTIMIZER_SHARD.fullmatch(path.name))
    }
    if not found:
        return None
    processes = max(count for count, _ in found.values())
    if sorted(found) != list(range(processes)) or {count for count, _ in found.values()} != {processes}:
        raise FileNotFoundError(f"{folder} holds {len(found)} of the {processes} optimizer shards of one state")
    shards = [_load(found[rank][1]) for rank in range(processes)]
    state = {
        index: {
            name: value if value.dim() == 0 else torch.cat([shard["state"][index][name] for shard in shards])
            for name, value in values.items()
        }
        for index, values in shards[0]["state"].items()
    }
    return {"state": state, "param_groups": shards[0]["param_groups"]}


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)
