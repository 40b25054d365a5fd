"""The model seam: the one place that loads (and saves) the models a stage needs, on its device, in its precision.

Every stage gets its actor, reference, critic and reward model from a :class:`ModelLoader`; no
stage calls ``from_pretrained`` itself. The loader also gives the stage its autocast context (its
``Accelerator`` is :func:`runtime.models.accelerator`'s, for the same device and precision).

Choices:
1. Roles: ``actor`` (a causal LM), ``reference`` (the frozen initial policy), ``critic``
   (backbone + value head) and ``reward_model`` (backbone + score head).
2. Weights: a model that is trained, and the actor wherever it is used, keeps fp32 weights (the
   master copy); under ``bf16`` / ``fp16`` it runs inside autocast, which is what Accelerate's
   mixed precision does in training. So every log-prob a rollout records is computed the way
   the update's forward computes it. Any other frozen model (reference, a critic or reward
   model used for scoring) is held in the precision's dtype: half the memory.
3. With LoRA (:class:`rlhf_core.config.LoraConfig`), a trained model is a frozen base in the
   precision's dtype plus fp32 adapters (peft); the reference is the actor with its adapters
   switched off (:class:`AdapterDisabled`), never a second copy of the base.
4. A model folder written by :func:`save_model_folder` holds the backbone's weights, or a LoRA
   adapter, or nothing but a reference to a *base* (a head-only critic over the initial policy),
   plus the head of a critic or reward model; ``rlhf_model.json`` says which. Bases are named
   (``policy``: the initial policy; ``reward_model``: a pretrained reward model) and the loader is
   given their folders, so an output never stores base weights twice and never depends on where
   the base lives.
5. A reward model may also be any ``AutoModelForSequenceClassification`` checkpoint with one label
   (its backbone, and its linear score head as the reward head).
6. A frozen model has gradients off and is in eval mode; a trained one has gradients on and,
   with ``gradient_checkpointing``, recomputes its activations in the backward pass (Hugging
   Face's checkpointing, non-reentrant; active in train mode only, see
   :func:`rlhf_core.models.dropout_disabled`).
7. On CUDA, weights are loaded straight onto the GPU (``device_map``), never staged in host memory.
8. ``fp16`` needs a GPU: Accelerate applies fp16 autocast and loss scaling on GPUs only, and would
   otherwise silently train in fp32.
9. Every load is recorded in :attr:`ModelLoader.loaded` (role, device, dtype, trainable), so a
   stage output can say where its models ran (and which it found in memory, see 10).
10. Frozen models may be kept between the stages of one process (a :class:`ModelCache`): the
   reference, the reward model and the actor an iteration samples with and evaluates are each
   used by two or three stages, and a stage that finds one in memory skips loading it. A
   trained model is always loaded afresh (its training must not touch what another stage holds).
11. A GGUF file is never loaded here: it is converted once, before any stage, into a folder
   (:mod:`rlhf_core.gguf`, the only other caller of ``from_pretrained``), which is loaded like any other.
12. A critic may be loaded from a reward model's folder (the campaign's first trained one, or a pretrained one):
   its backbone (or its LoRA adapter over its base) and its score head as the value head, as OpenRLHF and
   ColossalChat start the critic. Saved again, it is a critic.
13. A causal LM folder holding all its weights (an SFT output, the campaign's initial policy then) starts a critic or
   reward model to be trained as any Hugging Face causal LM folder does: its backbone, with a fresh head. A frozen
   one (a rollout's critic, a judge) is never made so: a fresh head there would be an untrained model read as a
   trained one, so a folder the pipeline saved still has to hold what the role asks for.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from rlhf_core.config import LoraConfig
from rlhf_core.models import Critic, RewardModel, freeze, hidden_size
from rlhf_core.precision import Precision, autocast, check_precision, compute_dtype
from rlhf_core.rewards import fold_normalisation

logger = logging.getLogger(__name__)

ModelRole = Literal["actor", "reference", "critic", "reward_model"]
ModelKind = Literal["causal_lm", "critic", "reward_model"]
MODEL_META_FILE = "rlhf_model.json"
_KIND_OF_ROLE: dict[str, ModelKind] = {
    "actor": "causal_lm",
    "reference": "causal_lm",
    "critic": "critic",
    "reward_model": "reward_model",
}
_HEADED = {"critic": Critic, "reward_model": RewardModel}


@dataclass(frozen=True)
class FolderMeta:
    """What a model folder written by :func:`save_model_folder` holds (``rlhf_model.json``).

    Args:
        kind: ``causal_lm``, ``critic`` or ``reward_model``.
        base: None when the folder holds the backbone's weights; else the name of the base model
            they come from (``policy`` or ``reward_model``).
        adapter: the folder holds a LoRA adapter (peft files) applied over the backbone.
    """

    kind: ModelKind
    base: str | None
    adapter: bool

    @classmethod
    def read(cls, folder: Path) -> FolderMeta | None:
        """The meta of ``folder``, or None for a plain Hugging Face folder."""
        path = Path(folder) / MODEL_META_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(kind=raw["kind"], base=raw["base"], adapter=bool(raw["adapter"]))

    @property
    def whole_causal_lm(self) -> bool:
        """A causal LM with all its weights (no base, no adapter): a Hugging Face folder like any other."""
        return self.kind == "causal_lm" and not self.base and not self.adapter

    def write(self, folder: Path) -> None:
        (Path(folder) / MODEL_META_FILE).write_text(json.dumps(asdict(self), sort_keys=True) + "\n")


def _peft():
    """peft, imported only when LoRA is used (it takes a second to import)."""
    import peft

    return peft


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` (or a critic's / reward model's backbone) carries LoRA adapters."""
    backbone = model.model if isinstance(model, Critic | RewardModel) else model
    return type(backbone).__module__.startswith("peft.")


class AdapterDisabled(nn.Module):
    """The base of a LoRA-adapted causal LM: the same weights with the adapters switched off.

    This is how the reference policy exists under LoRA: no second copy of the base in memory.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.training = model.training  # so that `evaluating` restores the actor's own mode, not train mode

    @property
    def config(self):
        return self.model.config

    def get_base_model(self) -> nn.Module:
        """The causal LM under the adapters, as a PEFT model gives it (e.g. to read its forward's parameters)."""
        return self.model.get_base_model()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


class ModelCache(Protocol):
    """Where frozen models are kept between stages and found again (:class:`runtime.models.FrozenModels`)."""

    def get(self, key: Hashable) -> nn.Module | None: ...

    def put(self, key: Hashable, model: nn.Module) -> None: ...


def _files_identity(*folders: Path) -> tuple[tuple[str, int, int, int], ...] | None:
    """Every file under ``folders``: (path, size, modification time in ns, inode), in path order; None
    where a file cannot be described (a dangling link, an unreadable folder): such a model is not kept."""

    def walk(folder: Path) -> Iterator[os.DirEntry]:
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                yield from walk(Path(entry.path))
            else:
                yield entry

    try:
        files = sorted((entry for folder in dict.fromkeys(folders) for entry in walk(folder)), key=lambda e: e.path)
        return tuple((entry.path, (stat := entry.stat()).st_size, stat.st_mtime_ns, stat.st_ino) for entry in files)
    except OSError:
        return None


def _describe(model: nn.Module) -> tuple[str, str]:
    parameter = next(model.parameters())
    return str(parameter.device), str(parameter.dtype).removeprefix("torch.")


class ModelLoader:
    """Loads a stage's models on one device, in one precision.

    Args:
        device: where every model runs (see :func:`rlhf_core.precision.resolve_device`).
        precision: ``fp32``, ``bf16`` or ``fp16``.
        gradient_checkpointing: trade compute for memory in trained models.
        bases: base-model name -> folder (``policy``: the initial policy, which is also the
            reference; ``reward_model``: a pretrained reward model).
        lora: adapters for models loaded trainable from full weights; None trains every weight.
        frozen_models: where frozen models are kept for the next stage and found again
            (:class:`ModelCache`); None loads every model from its folder.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        precision: Precision,
        gradient_checkpointing: bool = False,
        bases: Mapping[str, str | Path] | None = None,
        lora: LoraConfig | None = None,
        frozen_models: ModelCache | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.precision = check_precision(precision)
        if self.precision == "fp16" and self.device.type != "cuda":
            raise ValueError("`precision` fp16 needs a CUDA device (loss scaling); on the CPU use bf16 or fp32")
        self.gradient_checkpointing = gradient_checkpointing
        self.bases = {name: Path(folder) for name, folder in (bases or {}).items()}
        self.lora = lora
        self.frozen_models = frozen_models
        self.loaded: list[dict[str, Any]] = []
        """Every model loaded so far, in order: ``{"role", "device", "dtype", "trainable"}``, plus
        ``"adapters"`` (their dtype) for a LoRA model, ``"shares_weights_with"`` for a reference
        that is the actor with its adapters off and ``"kept_in_memory"`` for a model an earlier
        stage had loaded (:class:`FrozenModels`)."""

    # Loading ----------------------------------------------------------------------------------------

    def load(
        self,
        role: ModelRole,
        source: str | Path,
        *,
        trainable: bool = False,
        score_statistics: tuple[float, float] | None = None,
    ) -> nn.Module:
        """Load the model of ``role`` from the folder ``source``.

        Args:
            role: ``actor``, ``reference``, ``critic`` or ``reward_model``.
            source: a folder written by :func:`save_model_folder`, a plain Hugging Face folder,
                or (``reward_model``) an ``AutoModelForSequenceClassification`` checkpoint. For a
                critic or reward model, a folder without their head gives a freshly initialised head,
                which only a trained model may have (the caller seeds the initialisation).
            trainable: gradients on (for the adapters and head only, under LoRA); otherwise frozen.
            score_statistics: for a critic started from a reward model, the mean and std its scores are normalised
                by: folded into the value head, so that the critic starts predicting normalised scores
                (:func:`rlhf_core.rewards.fold_normalisation`).

        Returns:
            A causal LM (``actor``, ``reference``), a :class:`Critic` or a :class:`RewardModel`.
        """
        if role not in get_args(ModelRole):
            raise ValueError(f"`role` must be one of {get_args(ModelRole)}, got {role!r}")
        if role == "reference" and trainable:
            raise ValueError("the reference policy is frozen; it cannot be loaded trainable")
        source = Path(source)
        meta = FolderMeta.read(source)
        if meta is not None and meta.whole_causal_lm and role in ("critic", "reward_model") and trainable:
            meta = None  # a backbone as any Hugging Face causal LM folder is (choice 13)
        # a critic may start from a reward model (its backbone, and its score head as the value head: choice 12)
        starts_critic = role == "critic" and meta is not None and meta.kind == "reward_model"
        if meta is not None and meta.kind != _KIND_OF_ROLE[role] and not starts_critic:
            raise ValueError(f"{source} holds a {meta.kind}, not the {role} asked for")
        if score_statistics is not None and not starts_critic:
            raise ValueError(f"score statistics are folded into a critic started from a reward model, not {source}")
        base_name = meta.base if meta is not None and meta.base else self._base_name(source)
        weights = self._base_folder(meta.base) if meta is not None and meta.base else source
        with_adapter = meta is not None and meta.adapter
        new_adapter = trainable and self.lora is not None and not with_adapter
        if with_adapter or new_adapter:
            dtype = compute_dtype(self.precision)  # a frozen base; peft keeps the adapters in fp32
        elif trainable or role == "actor":
            dtype = torch.float32
        else:
            dtype = compute_dtype(self.precision)
        key = None if trainable else self._frozen_key(role, dtype, source, weights, score_statistics)
        if key is not None and (kept := self.frozen_models.get(key)) is not None:
            self._set_trainable(kept, False)  # eval mode again, whatever the last stage left
            self._record(role, kept, trainable, kept_in_memory=True)
            logger.info("kept in memory: %s from %s on %s", role, source, self.loaded[-1])
            return kept
        placement: dict[str, Any] = {"dtype": dtype}
        if self.device.type == "cuda":
            placement["device_map"] = {"": self.device}

        if role in ("actor", "reference"):
            model: nn.Module = AutoModelForCausalLM.from_pretrained(weights, **placement)
            model = self._adapt(model, source, with_adapter, new_adapter, trainable, task_type="CAUSAL_LM")
        else:
            backbone, weights_head = _backbone(weights, placement)
            backbone = self._adapt(backbone, source, with_adapter, new_adapter, trainable, task_type=None)
            model = _HEADED[role].wrap(backbone, weights_head)
            if starts_critic and weights_head is None:  # the reward head sits beside the adapter, not the base
                weights_head = model.head
                model.head.load_state_dict(load_file(source / f"{RewardModel.head_name}.safetensors"))
            if not model.load_head(source) and weights_head is None and not trainable:
                raise FileNotFoundError(
                    f"{source / (_HEADED[role].head_name + '.safetensors')} is missing: {source} is not a saved "
                    f"{_HEADED[role].__name__}"
                )
            if score_statistics is not None:  # folded in float32, whatever the head is then cast to
                fold_normalisation(model.head.float(), mean=score_statistics[0], std=score_statistics[1])
            model.head.to(dtype=torch.float32 if trainable or with_adapter or new_adapter else dtype)
        model.to(device=self.device)
        if not (with_adapter or new_adapter):
            model.to(dtype=dtype)
        model.rlhf_base = base_name  # type: ignore[attr-defined]  # where the backbone's weights come from
        self._set_trainable(model, trainable)
        self._record(role, model, trainable)
        logger.info("loaded %s from %s on %s", role, source, self.loaded[-1])
        if key is not None:
            self.frozen_models.put(key, model)
        return model

    def reference(self, actor: nn.Module | None = None) -> nn.Module:
        """The frozen initial policy: ``actor`` with its adapters off under LoRA, else the base loaded frozen."""
        if actor is not None and is_adapted(actor):
            view = AdapterDisabled(actor)
            self._record("reference", view, False, shares_weights_with="actor")
            return view
        if "policy" not in self.bases:
            raise ValueError("the loader knows no `policy` base to load the reference from")
        return self.load("reference", self.bases["policy"])

    def _adapt(
        self, model: nn.Module, source: Path, with_adapter: bool, new_adapter: bool, trainable: bool, *, task_type
    ) -> nn.Module:
        if with_adapter:
            return _peft().PeftModel.from_pretrained(model, source, is_trainable=trainable)
        if new_adapter:
            assert self.lora is not None
            config = _peft().LoraConfig(
                r=self.lora.r,
                lora_alpha=self.lora.alpha,
                lora_dropout=self.lora.dropout,
                target_modules=self.lora.target_modules
                if isinstance(self.lora.target_modules, str)
                else list(self.lora.target_modules),
                task_type=task_type,
            )
            return _peft().get_peft_model(model, config)
        return model

    def _frozen_key(
        self, role: str, dtype: torch.dtype, source: Path, weights: Path, folded: tuple[float, float] | None
    ) -> Hashable | None:
        """What a frozen model is kept under: role, device, dtype, its files and the statistics folded into its head;
        None where none is kept (no cache, a source that is not a folder, or files that cannot be described)."""
        if self.frozen_models is None or not (source.is_dir() and weights.is_dir()):
            return None
        identity = _files_identity(source, weights)
        return None if identity is None else (role, str(self.device), str(dtype), identity, folded)

    def _set_trainable(self, model: nn.Module, trainable: bool) -> None:
        if not trainable:
            freeze(model)
            return
        if is_adapted(model):  # peft already froze the base and left the adapters trainable
            if isinstance(model, Critic | RewardModel):
                model.head.requires_grad_(True)
        else:
            model.requires_grad_(True)
        if self.gradient_checkpointing:
            _enable_gradient_checkpointing(model)

    def _record(self, role: str, model: nn.Module, trainable: bool, **extra: str | bool) -> None:
        device, dtype = _describe(model)
        record = {"role": role, "device": device, "dtype": dtype, "trainable": trainable, **extra}
        if is_adapted(model) and "shares_weights_with" not in extra:
            record["adapters"] = "float32"  # over a frozen base in `dtype`
        self.loaded.append(record)

    def _base_name(self, folder: Path) -> str | None:
        """The name of the base whose folder ``folder`` is, or None."""
        resolved = folder.resolve()
        return next((name for name, base in self.bases.items() if base.resolve() == resolved), None)

    def _base_folder(self, name: str) -> Path:
        if name not in self.bases:
            raise ValueError(f"a model folder refers to the base {name!r}, which this run does not have")
        return self.bases[name]

    # Precision ---------------------------------------------------------------------------------------

    def autocast(self) -> AbstractContextManager[None]:
        """The forward-pass context of this precision (see :func:`rlhf_core.precision.autocast`)."""
        return autocast(self.device, self.precision)


def _backbone(folder: Path, placement: dict[str, Any]) -> tuple[PreTrainedModel, nn.Linear | None]:
    """The backbone in ``folder`` and the head it comes with: the score head of a sequence-classification
    checkpoint, or a head this project saved beside it (a reward model's score head starts a critic's
    value head, when the critic starts from a reward model); None for a plain backbone."""
    architectures = getattr(AutoConfig.from_pretrained(folder), "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        backbone = AutoModel.from_pretrained(folder, **placement)
        for kind in (RewardModel, Critic):
            head_file = Path(folder) / f"{kind.head_name}.safetensors"
            if head_file.is_file():
                head = nn.Linear(hidden_size(backbone.config), 1)
                head.load_state_dict(load_file(head_file))
                return backbone, head
        return backbone, None
    classifier = AutoModelForSequenceClassification.from_pretrained(folder, **placement)
    if classifier.config.num_labels != 1:
        raise ValueError(f"{folder} has {classifier.config.num_labels} labels; a reward model has exactly one")
    score = getattr(classifier, "score", None) or getattr(classifier, "classifier", None)
    if not isinstance(score, nn.Linear):
        raise ValueError(f"{folder}: the classification head is not one linear layer, so it cannot be a reward head")
    head = nn.Linear(score.in_features, 1)
    with torch.no_grad():
        head.weight.copy_(score.weight.float())
        head.bias.copy_(score.bias.float() if score.bias is not None else torch.zeros(1))
    return classifier.base_model, head


def has_reward_head(folder: str | Path) -> bool:
    """Whether the folder holds a reward model that can score as it is: a sequence-classification checkpoint, or a
    backbone with the reward head this project saves beside it (:func:`save_model_folder`); a plain causal LM has
    none (a head would be fresh: random scores)."""
    folder = Path(folder)
    if (folder / f"{RewardModel.head_name}.safetensors").is_file():
        return True
    architectures = getattr(AutoConfig.from_pretrained(folder), "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def count_parameters(folder: str | Path) -> int:
    """The parameters of the model in a Hugging Face folder, from its safetensors headers (nothing is loaded); a
    folder of pickled weights is estimated from their bytes at 4 per parameter."""
    from safetensors import safe_open

    folder = Path(folder)
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                total += math.prod(weights.get_slice(name).get_shape())
    if total == 0:
        total = sum(path.stat().st_size for path in folder.glob("pytorch_model*.bin")) // 4
    return total


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    backbone = model.model if isinstance(model, Critic | RewardModel) else model
    if is_adapted(model):
        backbone = backbone.get_base_model()
    if not isinstance(backbone, PreTrainedModel) or not backbone.supports_gradient_checkpointing:
        raise ValueError(f"{type(backbone).__name__} does not support gradient checkpointing")
    options = {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):  # transformers 5.x; the old name is deprecated
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


@contextmanager
def _sets_sorted(configs: Iterable[Any]) -> Iterator[None]:
    """The set-valued fields of PEFT ``configs`` as sorted lists while inside: PEFT writes a set (``target_modules``
    as ``all-linear`` resolves) in the process's string-hash order, so the same adapter's ``adapter_config.json``
    differed from one process to the next, and with it every output made from it."""
    swapped = [
        (config, name, value) for config in configs for name, value in vars(config).items() if isinstance(value, set)
    ]
    for config, name, value in swapped:
        setattr(config, name, sorted(value))
    try:
        yield
    finally:
        for config, name, value in swapped:
            setattr(config, name, value)


def save_model_folder(
    model: nn.Module,
    directory: str | Path,
    *,
    weights: bool = True,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> FolderMeta:
    """Save a model the seam loaded, holding no base weights twice.

    A LoRA-adapted model saves its adapter; otherwise the backbone's weights are saved, unless
    ``weights`` is False (the model is its base, unchanged: e.g. the first actor, or a critic that is
    the base plus a fresh head). A critic's or reward model's head is always saved. ``state_dict`` is the
    whole model's state where ``model`` holds only a shard of it (FSDP): that is what is saved then.

    Raises:
        ValueError: ``weights`` is False for a model not loaded from a named base.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    headed = model if isinstance(model, Critic | RewardModel) else None
    backbone = headed.model if headed is not None else model
    kind: ModelKind = "causal_lm" if headed is None else ("critic" if isinstance(headed, Critic) else "reward_model")
    base = getattr(model, "rlhf_base", None)
    adapted = is_adapted(model)
    if adapted or not weights:
        if base is None:
            raise ValueError("this model was not loaded from a named base, so its backbone's weights must be saved")
    backbone_state, head_state = _split_state(state_dict, headed)
    given = {} if backbone_state is None else {"state_dict": backbone_state}
    if adapted:
        for config in backbone.peft_config.values():  # say which base, not where it lived on this machine
            config.base_model_name_or_path = base
        with _sets_sorted(backbone.peft_config.values()):
            backbone.save_pretrained(directory, save_embedding_layers=False, **given)  # adapters never touch embeddings
    elif weights:
        backbone.save_pretrained(directory, **given)
    if headed is not None:
        headed.save_head(directory, state=head_state)
    meta = FolderMeta(kind=kind, base=base if adapted or not weights else None, adapter=adapted)
    meta.write(directory)
    return meta


def _split_state(
    state_dict: Mapping[str, torch.Tensor] | None, headed: nn.Module | None
) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """A headed model's whole state as its backbone's and its head's (keys relative to each); (state, None)
    for a causal LM; (None, None) for no state."""
    if state_dict is None:
        return None, None
    if headed is None:
        return dict(state_dict), None
    head = f"{headed.head_name}."
    backbone = {key[len("model.") :]: value for key, value in state_dict.items() if key.startswith("model.")}
    return backbone, {key[len(head) :]: value for key, value in state_dict.items() if key.startswith(head)}


def merged(model: nn.Module) -> nn.Module:
    """The model with its LoRA adapters merged into the base weights (unchanged without adapters)."""
    if not is_adapted(model):
        return model
    if isinstance(model, Critic | RewardModel):
        return type(model).wrap(model.model.merge_and_unload(), model.head)
    return model.merge_and_unload()
