"""What a stage task knows about where it runs: the :class:`StageContext`.

A task receives the context plus exactly the settings and upstream outputs it uses (see
:mod:`runtime.stage`). The context holds what is common to every stage of an iteration:

* where outputs go (``layout``) and where they are recorded (``tracking``, ``experiment_id``,
  the iteration's MLflow run);
* the coordinates every stage seed derives from (``seed``, ``iteration``) and the campaign's base
  inputs (initial policy, tokenizer, prompt files), identified by their content; these are part
  of every input key;
* how stages run (``execution``: device, threads, checkpoint pacing, gradient checkpointing, task runner,
  training processes),
  which is never part of an input key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.references import (
    EnvironmentReference,
    JudgeReference,  # at run time: a flow validates the base inputs it is given
    RewardFunctionReference,
)
from runtime.seeds import stage_seed
from storage.layout import RunLayout

if TYPE_CHECKING:  # neither torch nor MLflow at import: a command that only locates its inputs starts without them
    import torch

    from rlhf_core.config import LoraConfig, Precision, Sharding
    from rlhf_core.loading import ModelLoader
    from storage.tracking import Tracker


@dataclass(frozen=True)
class InputFile:
    """A file (or folder) the pipeline reads, named by its path and identified by its content.

    In an input key only ``sha256`` counts: the same content at another path is the same input,
    and a file edited in place is a new one.

    Args:
        path: the file or folder the stages read.
        sha256: its content's fingerprint (a folder converted from ``source`` included: the weights the stages read).
        source: the file ``path`` was converted from (a GGUF model, :mod:`campaign.model_sources`), or None.
        source_sha256: that file's content's fingerprint, or None.
    """

    path: str
    sha256: str
    source: str | None = None
    source_sha256: str | None = None


@dataclass(frozen=True)
class BaseInputs:
    """The campaign's fixed inputs, each identified by its content.

    Args:
        policy: the initial policy (also the frozen reference), a Hugging Face folder.
        tokenizer: the tokenizer's folder (often the policy's).
        prompts: training prompts.
        eval_prompts: held-out prompts.
        judge: the gold judge (a :class:`rlhf_core.evaluation.Judge` named ``module:attribute``),
            or None when no gold judge applies.
        preferences: the file of preference pairs to import (labeler ``import``), or None. Only
            the preference stage reads it, so it is that stage's setting, not in :attr:`fingerprint`.
        reward_model: a pretrained reward model folder (with its own tokenizer), or None.
        reward_function: the reward function that scores rollouts (``reward.source: function``),
            or None when a reward model does. A setting of the stages that score, like ``judge``.
        rubric: the reward function that labels candidate pairs (labeler ``function``) and scores
            evaluation's responses beside the reward model, or None.
        environment: the environment class of multi-turn episodes (``environment.class``), or None: a setting of
            the rollout, keyed by its module's code like ``reward_function``.
        sft_data: the demonstrations the initial policy is fine-tuned on (``sft.data``), or None. Only the SFT stage
            reads it (a setting of its own, like ``preferences``, not in :attr:`fingerprint`).
        pretrained: the policy SFT started from (``model.policy``) once :attr:`policy` is the SFT output
            (:meth:`supervised`), or None. :attr:`contents` records it as the ``policy``, beside the ``sft_data``
            (and the SFT output as ``sft``): the files a campaign starts from read the same before its SFT stage ran
            in a command and after.
    """

    policy: InputFile
    tokenizer: InputFile
    prompts: InputFile
    eval_prompts: InputFile
    judge: JudgeReference | None = None
    preferences: InputFile | None = None
    reward_model: InputFile | None = None
    reward_function: RewardFunctionReference | None = None
    rubric: RewardFunctionReference | None = None
    environment: EnvironmentReference | None = None
    sft_data: InputFile | None = None
    pretrained: InputFile | None = None

    @property
    def awaits_sft(self) -> bool:
        """Whether the initial policy is still to be fine-tuned on :attr:`sft_data` (:meth:`supervised`)."""
        return self.sft_data is not None and self.pretrained is None

    def supervised(self, policy: InputFile) -> BaseInputs:
        """These inputs with ``policy`` (the SFT stage's output) as the initial policy, and so the reference, of every
        stage; the pretrained one kept as :attr:`pretrained`."""
        return replace(self, policy=policy, pretrained=self.policy)

    @property
    def bases(self) -> dict[str, str]:
        """Base-model name -> folder, for :class:`rlhf_core.loading.ModelLoader`."""
        return {"policy": self.policy.path, **({"reward_model": self.reward_model.path} if self.reward_model else {})}

    @property
    def reward_tokenizer(self) -> str:
        """The folder of the reward model's tokenizer: a pretrained reward model's own, else the policy's."""
        return (self.reward_model or self.tokenizer).path

    @property
    def contents(self) -> dict[str, str]:
        """``{field: sha256}`` of every input file (``policy``, ``prompts``, ...; the tokenizer only when it is
        not the policy's own): what a manifest and an iteration run record of the inputs that produced them."""
        policy = self.pretrained or self.policy
        files = {
            "policy": policy,
            "tokenizer": None if self.tokenizer == policy else self.tokenizer,
            "prompts": self.prompts,
            "eval_prompts": self.eval_prompts,
            "preferences": self.preferences,
            "reward_model": self.reward_model,
            "sft_data": self.sft_data,
            "sft": None if self.pretrained is None else self.policy,
        }
        return {name: file.sha256 for name, file in files.items() if file is not None}

    @property
    def sources(self) -> dict[str, dict[str, str]]:
        """Setting -> ``{"file", "sha256", "folder"}`` of each model converted from another file (a GGUF file),
        for stage manifests to record; empty when none was."""
        policy = self.pretrained or self.policy
        tokenizer = None if self.tokenizer is policy else self.tokenizer  # the policy's own, said once
        named = (
            ("model.policy", policy),
            ("model.tokenizer", tokenizer),
            ("model.reward_model", self.reward_model),
        )
        return {
            setting: {"file": part.source, "sha256": part.source_sha256, "folder": part.path}
            for setting, part in named
            if part is not None and part.source is not None
        }

    @property
    def fingerprint(self) -> str:
        """One hash of the contents of the base files stages compute from, part of every input key: all but the
        held-out prompts, which only the stages that read them (the reference's samples and the evaluation) declare
        as a setting (``base.eval_prompts``), so another file re-keys those two alone (issue 42); and the imported
        preferences, a setting of the stage that reads them."""
        parts = (self.policy, self.tokenizer, self.prompts, self.reward_model)
        return hashlib.sha256("/".join(part.sha256 if part else "-" for part in parts).encode()).hexdigest()


@dataclass(frozen=True)
class Execution:
    """How stages run. Never part of an input key (but for the generation engine's identity): the same outputs come
    from any of these.

    Args:
        device: ``auto``, ``cpu`` or ``cuda`` (see :func:`rlhf_core.precision.resolve_device`).
        torch_threads: torch intra-op threads, set at the start of every stage (`auto` already resolved).
        checkpoint_seconds: save mid-stage progress at most this often.
        gradient_checkpointing: recompute activations in the backward pass of trained models.
        task_runner: where generation stages run their shards: ``local``, ``dask`` or ``ray`` (:mod:`runtime.fanout`).
        address: the Dask scheduler or Ray cluster the shards run on (None: this process, or a local Ray).
        training_processes: processes the training stages run in (:mod:`runtime.launch`).
        accelerate_config: an ``accelerate config`` file for those processes, or None.
        training_launcher: ``accelerate`` (``accelerate launch`` on this machine) or ``ray`` (Ray Train workers on
            the Ray cluster at ``address``).
        rendezvous_timeout: seconds the training processes may take to all start and meet.
        sharding: how the trained models are sharded over those processes (FSDP2, from ``accelerate_config``), or
            None (data parallel).
        frozen_model_bytes: frozen models kept in memory between a process's stages, in bytes (0: none;
            :class:`runtime.models.FrozenModels`).
        own_process: a training stage trains in a process of its own even with one process (:mod:`runtime.launch`):
            the stage's own process samples the next iteration meanwhile (``sampling.staleness``).
        engine_url: the generation engine server the stages sample on (``sampling.engine: vllm``), or None.
        engine: what that engine samples with (:func:`runtime.engine.engine_identity`): part of the key of every
            stage that samples on it, unlike everything else here.
    """

    device: str = "auto"
    torch_threads: int = 1
    checkpoint_seconds: float = 60.0
    gradient_checkpointing: bool = False
    task_runner: str = "local"
    address: str | None = None
    training_processes: int = 1
    accelerate_config: str | None = None
    training_launcher: str = "accelerate"
    rendezvous_timeout: float = 300.0
    sharding: Sharding | None = None
    frozen_model_bytes: int = 0
    own_process: bool = False
    engine_url: str | None = None
    engine: dict[str, Any] | None = None

    @property
    def engine_vllm(self) -> str | None:
        """The vLLM version of the generation engine, from its identity; None without an engine."""
        return None if self.engine is None else self.engine.get("vllm")

    def model_loader(
        self, precision: Precision, *, bases: dict[str, str], lora: LoraConfig | None = None
    ) -> ModelLoader:
        """The model seam for one stage (:class:`rlhf_core.loading.ModelLoader`)."""
        from rlhf_core.loading import ModelLoader
        from rlhf_core.precision import resolve_device
        from runtime.models import PROCESS_FROZEN_MODELS

        PROCESS_FROZEN_MODELS.resize(self.frozen_model_bytes)
        return ModelLoader(
            device=resolve_device(self.device),
            precision=precision,
            gradient_checkpointing=self.gradient_checkpointing,
            bases=bases,
            lora=lora,
            frozen_models=PROCESS_FROZEN_MODELS if self.frozen_model_bytes else None,
        )


@dataclass(frozen=True)
class TrackingStore:
    """An MLflow store: its tracking URI, where new experiments keep their artifacts, and where its UI is (None:
    :class:`storage.tracking.Tracker`'s default)."""

    uri: str
    artifact_root: str | None
    ui_url: str | None = None

    def tracker(self) -> Tracker:
        from storage.tracking import open_tracker

        return open_tracker(self.uri, self.artifact_root, self.ui_url)


@dataclass(frozen=True)
class StageContext:
    """Everything a stage task needs to know about where it runs (see the module docstring)."""

    layout: RunLayout
    tracking: TrackingStore
    campaign: str
    experiment_id: str
    iteration: int
    seed: int
    base: BaseInputs
    execution: Execution
    parent_run_id: str | None = None
    flow_run_id: str | None = None
    register_models: bool = True
    """Register new actor, critic and reward-model versions in MLflow (off for replays)."""
    records: bool = True
    """Record each stage output in MLflow. False for the stages of an iteration computed ahead, while the previous
    iteration's update runs (``sampling.staleness``): its iteration records them when it calls them (and reuses
    them)."""
    fingerprints: Path | None = None
    """The run root's fingerprint cache (:mod:`storage.fingerprints`), where each output's files are remembered as
    their stage writes them; None: not remembered."""

    @property
    def tracker(self) -> Tracker:
        return self.tracking.tracker()

    def stage_seed(self, stage: str) -> int:
        return stage_seed(self.seed, stage, self.iteration)

    def generator(self, stage: str) -> torch.Generator:
        """A CPU generator seeded from ``(seed, stage, iteration)``."""
        import torch

        return torch.Generator().manual_seed(self.stage_seed(stage))
