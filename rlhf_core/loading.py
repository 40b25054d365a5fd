"""The model seam: the one place that loads the models a stage needs, onto its device, in its precision.

Every stage gets its actor, reference, critic and reward model from a :class:`ModelLoader`; no
stage calls ``from_pretrained`` itself. The loader also builds the stage's ``Accelerator`` and
its autocast context, so device and precision are decided here and nowhere else.

Choices:
1. Roles: ``actor`` (a causal LM), ``reference`` (the frozen initial policy), ``critic``
   (backbone + value head) and ``reward_model`` (backbone + score head).
2. Weights: a model that is trained, and the actor wherever it is used, keeps fp32 weights (the
   master copy); under ``bf16`` / ``fp16`` it runs inside autocast, which is what Accelerate's
   mixed precision does in training. So every log-prob a rollout records is computed the way
   the update's forward computes it. Any other frozen model (reference, a critic or reward
   model used for scoring) is held in the precision's dtype: half the memory.
3. A frozen model has gradients off and is in eval mode; a trained one has gradients on and,
   with ``gradient_checkpointing``, recomputes its activations in the backward pass (Hugging
   Face's checkpointing, non-reentrant; active in train mode only, see
   :func:`rlhf_core.models.dropout_disabled`).
4. On CUDA, weights are loaded straight onto the GPU (``device_map``), never staged in host memory.
5. ``fp16`` needs a GPU: Accelerate applies fp16 autocast and loss scaling on GPUs only, and would
   otherwise silently train in fp32.
6. Every load is recorded in :attr:`ModelLoader.loaded` (role, device, dtype, trainable), so a
   stage output can say where its models ran.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, DistributedType
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf_core.models import Critic, RewardModel, freeze
from rlhf_core.precision import Precision, accelerate_mixed_precision, autocast, check_precision, compute_dtype

logger = logging.getLogger(__name__)

ModelRole = Literal["actor", "reference", "critic", "reward_model"]


def _describe(model: nn.Module) -> tuple[str, str]:
    parameter = next(model.parameters())
    return str(parameter.device), str(parameter.dtype).removeprefix("torch.")


class ModelLoader:
    """Loads a stage's models on one device, in one precision.

    Args:
        device: where every model runs (see :func:`rlhf_core.precision.resolve_device`).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        gradient_checkpointing: trade compute for memory in trained models.
    """

    def __init__(self, *, device: torch.device, precision: Precision, gradient_checkpointing: bool = False) -> None:
        self.device = torch.device(device)
        self.precision = check_precision(precision)
        if self.precision == "fp16" and self.device.type != "cuda":
            raise ValueError("`precision` fp16 needs a CUDA device (loss scaling); on the CPU use bf16 or fp32")
        self.gradient_checkpointing = gradient_checkpointing
        self.loaded: list[dict[str, Any]] = []
        """Every model loaded so far, in order: ``{"role", "device", "dtype", "trainable"}``."""

    def load(self, role: ModelRole, source: str | Path, *, trainable: bool = False) -> nn.Module:
        """Load the model of ``role`` from the folder (or hub name) ``source``.

        Args:
            role: ``actor``, ``reference``, ``critic`` or ``reward_model``.
            source: a ``save_pretrained`` folder. For ``critic`` and ``reward_model`` a plain
                causal-LM folder gives a freshly initialised head, which only a trained model
                may have (the caller seeds the initialisation).
            trainable: gradients on (and checkpointing, if set); otherwise frozen.

        Returns:
            A causal LM (``actor``, ``reference``), a :class:`Critic` or a :class:`RewardModel`.
        """
        if role not in get_args(ModelRole):
            raise ValueError(f"`role` must be one of {get_args(ModelRole)}, got {role!r}")
        if role == "reference" and trainable:
            raise ValueError("the reference policy is frozen; it cannot be loaded trainable")
        dtype = torch.float32 if trainable or role == "actor" else compute_dtype(self.precision)
        placement: dict[str, Any] = {"dtype": dtype}
        if self.device.type == "cuda":
            placement["device_map"] = {"": self.device}
        if role in ("actor", "reference"):
            model: nn.Module = AutoModelForCausalLM.from_pretrained(source, **placement)
        else:
            model_class = Critic if role == "critic" else RewardModel
            model = model_class.from_pretrained(source, require_head=not trainable, **placement)
        model.to(device=self.device, dtype=dtype)
        if trainable:
            model.requires_grad_(True)
            if self.gradient_checkpointing:
                _enable_gradient_checkpointing(model)
        else:
            freeze(model)
        device, dtype_name = _describe(model)
        self.loaded.append({"role": role, "device": device, "dtype": dtype_name, "trainable": trainable})
        logger.info(
            "loaded %s from %s on %s (%s%s)", role, source, device, dtype_name, ", trainable" if trainable else ""
        )
        return model

    def autocast(self) -> AbstractContextManager[None]:
        """The forward-pass context of this precision (see :func:`rlhf_core.precision.autocast`)."""
        return autocast(self.device, self.precision)

    def accelerator(self) -> Accelerator:
        """An ``Accelerator`` on this device with this precision as its mixed precision.

        Accelerate keeps its state in a process-wide singleton that refuses a second precision;
        a process running one stage after another (one precision each) resets it when it must.
        Under ``accelerate launch`` the launch decides, and nothing is reset.
        """
        mixed_precision = accelerate_mixed_precision(self.precision)
        shared = AcceleratorState._shared_state
        if shared and shared.get("distributed_type", DistributedType.NO) == DistributedType.NO:
            if shared.get("_mixed_precision") != mixed_precision or shared.get("device") != self.device:
                AcceleratorState._reset_state(reset_partial_state=True)
        return Accelerator(cpu=self.device.type == "cpu", mixed_precision=mixed_precision)


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    backbone = model.model if isinstance(model, Critic | RewardModel) else model
    if not isinstance(backbone, PreTrainedModel) or not backbone.supports_gradient_checkpointing:
        raise ValueError(f"{type(backbone).__name__} does not support gradient checkpointing")
    options = {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):  # transformers 5.x; the old name is deprecated
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
