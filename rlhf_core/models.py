"""Critic and RewardModel: any Hugging Face decoder backbone plus a linear head.

Choices:
1. The backbone is whatever ``AutoModel`` builds for the checkpoint or config (GPT-2, Llama,
   Qwen2, ...), so anything ``AutoModelForCausalLM`` loads also works here.
2. Position ids come from the attention mask (:func:`position_ids_from_mask`), so left or right
   padding never changes a score or a value.
3. ``save_pretrained`` writes the backbone as an ordinary Hugging Face folder and the head beside
   it as ``<head>.safetensors``; nothing is ever pickled. (The pipeline saves through the model
   seam, :func:`rlhf_core.loading.save_model_folder`, which can also save a LoRA adapter or only a
   reference to a base model instead of the backbone's weights.)
4. The reward head is initialised normal(0, 1/(H+1)) as in ColossalChat's RewardModel; the value
   head keeps PyTorch's default Linear initialisation.
5. Inside :func:`fused_activations`, GPT-2's Python tanh-GELU runs as PyTorch's fused kernel (the
   same function up to float rounding); it took about a fifth of a PPO update's time on CPU. The
   models are restored on exit, so a model outside rlhf_core calls computes exactly as loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from rlhf_core.sequences import last_token_index, position_ids_from_mask

_PYTHON_TANH_GELUS = frozenset({"NewGELUActivation", "FastGELUActivation"})
"""transformers' Python spellings of ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (``gelu_new``, ``gelu_fast``)."""


class FusedTanhGELU(nn.Module):
    """``gelu(x, approximate="tanh")``: one kernel where the Python form runs about eight elementwise
    passes forward and more backward. Equal to it up to float rounding."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.gelu(input, approximate="tanh")


@contextmanager
def fused_activations(*models: object) -> Iterator[None]:
    """Run every ``nn.Module`` among ``models`` with :class:`FusedTanhGELU` for Python tanh-GELUs.

    The original activation modules are put back on exit. Other activations (SiLU, exact GELU)
    are single kernels already and are left alone.
    """
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for model in models:
        if not isinstance(model, nn.Module):
            continue
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child).__name__ in _PYTHON_TANH_GELUS:
                    swapped.append((parent, name, child))
                    setattr(parent, name, FusedTanhGELU())
    try:
        yield
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def _load_backbone(pretrained: str | Path | None, config: PretrainedConfig | None, **kwargs) -> PreTrainedModel:
    if (pretrained is None) == (config is None):
        raise ValueError("pass exactly one of `pretrained` (a name or folder) and `config`")
    if pretrained is not None:
        return AutoModel.from_pretrained(pretrained, **kwargs)
    return AutoModel.from_config(config, **kwargs)


def hidden_size(config: PretrainedConfig) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None) is not None:
            return int(getattr(config, name))
    raise ValueError(f"cannot find the hidden size of config {type(config).__name__}")


class _HeadedBackbone(nn.Module):
    """A backbone plus a named linear head, saved side by side."""

    head_name: str

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.model = backbone
        setattr(self, self.head_name, head)

    @property
    def head(self) -> nn.Linear:
        return getattr(self, self.head_name)

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()

    def last_hidden_state(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Shapes: input_ids, attention_mask: (B, T); returns (B, T, H)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return outputs.last_hidden_state

    def save_pretrained(self, directory: str | Path, **kwargs) -> None:
        """Write the backbone (Hugging Face folder) and the head (safetensors) into ``directory``."""
        directory = Path(directory)
        self.model.save_pretrained(directory, **kwargs)
        self.save_head(directory)

    def save_head(self, directory: str | Path, *, state: dict[str, torch.Tensor] | None = None) -> None:
        """Write only the head, as ``<directory>/<head_name>.safetensors`` (``state``: the head's whole state,
        where this process holds only a shard of it)."""
        state = self.head.state_dict() if state is None else state
        head_state = {key: value.detach().contiguous().cpu() for key, value in state.items()}
        save_file(head_state, Path(directory) / f"{self.head_name}.safetensors")

    def load_head(self, directory: str | Path) -> bool:
        """Load the head saved in ``directory``; False (head unchanged) when there is none."""
        head_file = Path(directory) / f"{self.head_name}.safetensors"
        if not head_file.is_file():
            return False
        self.head.load_state_dict(load_file(head_file))
        return True

    @classmethod
    def wrap(cls, backbone: nn.Module, head: nn.Linear | None = None):
        """An instance around an existing backbone (e.g. a LoRA-wrapped one), with ``head`` or a fresh one."""
        model = cls.__new__(cls)
        _HeadedBackbone.__init__(
            model, backbone, head if head is not None else cls.new_head(hidden_size(backbone.config))
        )
        return model

    @staticmethod
    def new_head(hidden_size: int) -> nn.Linear:
        """A freshly initialised head (PyTorch's default Linear initialisation)."""
        return nn.Linear(hidden_size, 1)

    @classmethod
    def from_pretrained(cls, pretrained: str | Path, *, require_head: bool = False, **kwargs):
        """Load a backbone; its head too when ``pretrained`` is a folder this class saved.

        A plain Hugging Face checkpoint (e.g. the actor's) gets a freshly initialised head, unless
        ``require_head``: then a missing head is a FileNotFoundError naming the folder.
        """
        head_file = Path(pretrained) / f"{cls.head_name}.safetensors"
        if require_head and not head_file.is_file():
            raise FileNotFoundError(f"{head_file} is missing: {pretrained} is not a saved {cls.__name__}")
        model = cls(pretrained=pretrained, **kwargs)
        model.load_head(pretrained)
        return model


class Critic(_HeadedBackbone):
    """Backbone plus a linear value head over the last hidden state: one value per position.

    Build from a name or folder (``Critic(pretrained=...)``, ``Critic.from_pretrained(...)``) or
    from a config (``Critic(config=...)``).
    """

    head_name = "value_head"

    def __init__(self, pretrained: str | Path | None = None, config: PretrainedConfig | None = None, **kwargs) -> None:
        backbone = _load_backbone(pretrained, config, **kwargs)
        super().__init__(backbone, self.new_head(hidden_size(backbone.config)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-position values.

        Shapes:
            input_ids, attention_mask: (B, T); returns (B, T) float32.
        """
        hidden = self.last_hidden_state(input_ids, attention_mask)  # (B, T, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)


class RewardModel(_HeadedBackbone):
    """Backbone plus a linear head read at the last non-padding token: one score per sequence."""

    head_name = "reward_head"

    def __init__(self, pretrained: str | Path | None = None, config: PretrainedConfig | None = None, **kwargs) -> None:
        backbone = _load_backbone(pretrained, config, **kwargs)
        super().__init__(backbone, self.new_head(hidden_size(backbone.config)))

    @staticmethod
    def new_head(hidden_size: int) -> nn.Linear:
        """A fresh score head: weight normal(0, 1/(H+1)), bias 0 (ColossalChat's initialisation)."""
        head = nn.Linear(hidden_size, 1)
        nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(head.bias)
        return head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence scores.

        Shapes:
            input_ids, attention_mask: (B, T); returns (B,) float32.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.last_hidden_state(input_ids, attention_mask)  # (B, T, H)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last_hidden = hidden[rows, last_token_index(attention_mask)]  # (B, H)
        return self.reward_head(last_hidden).squeeze(-1).float()  # (B,)


def freeze(model: nn.Module) -> nn.Module:
    """Put ``model`` in eval mode with gradients off (the frozen reference policy)."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


@contextmanager
def evaluating(*models: object) -> Iterator[None]:
    """Put every ``nn.Module`` among ``models`` in eval mode (dropout off), restoring modes after."""
    modules = [model for model in models if isinstance(model, nn.Module)]
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            module.train(mode)


@contextmanager
def dropout_disabled(*models: object) -> Iterator[None]:
    """Train mode with every dropout probability set to 0, restoring both on exit.

    The forward then computes what eval mode computes, while train-mode features stay on
    (gradient checkpointing runs only in train mode). Covers ``nn.Dropout`` modules and the float
    ``attention_dropout`` / ``dropout`` attributes Hugging Face attention layers read in training.
    """
    modules = [model for model in models if isinstance(model, nn.Module)]
    modes = [module.training for module in modules]
    changed: list[tuple[object, str, float]] = []
    for module in modules:
        for child in module.modules():
            if isinstance(child, nn.Dropout) and child.p:
                changed.append((child, "p", child.p))
                child.p = 0.0
            for name in ("attention_dropout", "dropout"):
                value = getattr(child, name, None)
                if isinstance(value, float) and value:
                    changed.append((child, name, value))
                    setattr(child, name, 0.0)
        module.train()
    try:
        yield
    finally:
        for owner, name, value in reversed(changed):
            setattr(owner, name, value)
        for module, mode in zip(modules, modes, strict=True):
            module.train(mode)
