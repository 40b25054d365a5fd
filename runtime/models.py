"""What a process keeps for the stages it runs: the frozen models it holds between them, and Accelerate's state.

Both are process-wide: the models a stage finds in memory skip loading (:class:`FrozenModels`, the
:class:`rlhf_core.loading.ModelCache` of :class:`rlhf_core.loading.ModelLoader`), and Accelerate keeps its state in a
singleton that one process running stage after stage must reset between precisions (:func:`accelerator`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, DistributedType
from torch import nn

from rlhf_core.precision import Precision, accelerate_mixed_precision


class FrozenModels:
    """Frozen models kept in memory between the stages of one process, least recently used first out.

    A model is found again only if it would load the same: the same role, device, dtype and files, each
    file named by path, size, modification time and inode, so a folder written again (a crashed stage
    redone, an output deleted and recomputed) is loaded again. Stage outputs are never changed in
    place, so in a campaign that happens only when they are replaced.

    Args:
        max_bytes: the most parameter and buffer bytes held; a model larger than this is never kept,
            and 0 keeps none. The models stay on their device: on a GPU this memory is taken from the
            stages that train.
    """

    def __init__(self, max_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self._models: OrderedDict[Hashable, tuple[nn.Module, int]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes()

    def _held_bytes(self) -> int:
        return sum(size for _, size in self._models.values())

    def get(self, key: Hashable) -> nn.Module | None:
        with self._lock:
            if key not in self._models:
                return None
            self._models.move_to_end(key)
            return self._models[key][0]

    def put(self, key: Hashable, model: nn.Module) -> None:
        size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        with self._lock:
            self._models.pop(key, None)
            if size <= self.max_bytes:
                self._models[key] = (model, size)
            self._evict()

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._models.clear()

    def _evict(self) -> None:
        while self._models and self._held_bytes() > self.max_bytes:
            self._models.popitem(last=False)


PROCESS_FROZEN_MODELS = FrozenModels()
"""The frozen models this process keeps between its stages (see :meth:`FrozenModels.resize` for its bound)."""


def accelerator_for(device: torch.device, precision: Precision) -> Accelerator:
    """An ``Accelerator`` on ``device`` with ``precision`` as its mixed precision.

    Accelerate keeps its state in a process-wide singleton that refuses a second precision;
    a process running one stage after another (one precision each) resets it when it must.
    Under ``accelerate launch`` the launch decides, and nothing is reset.
    """
    mixed_precision = accelerate_mixed_precision(precision)
    shared = AcceleratorState._shared_state
    if shared and shared.get("distributed_type", DistributedType.NO) == DistributedType.NO:
        if shared.get("_mixed_precision") != mixed_precision or shared.get("device") != device:
            AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision)
