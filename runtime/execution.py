"""Where and how fast a stage's work runs: the ``execution`` section of the config (:class:`ExecutionConfig`).

None of it changes an output, so it is part of no input key and of no campaign's identity: a campaign may continue
anywhere, and a replay may change any of it (docs/scaling.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf_core.config import DeviceChoice, Sharding


class Settings(BaseModel):
    """A section of the config: frozen, no unknown keys, each field documented by the string below it."""

    # No NaN or infinity in any number; the stage configs refuse them in their own checks.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


class ExecutionConfig(Settings):
    """Where and how fast the stages' work runs: the device and threads, how often training saves its progress,
    on which engine the generation stages fan out, how many processes train. None of it changes an output, so it
    is part of no input key and of no campaign's identity: a campaign may continue anywhere, and a replay may
    change any of it (docs/scaling.md)."""

    device: DeviceChoice = "auto"
    """Where every model runs: `auto` (CUDA when torch sees a GPU, else the CPU), `cpu` or `cuda`. Outputs are the
    same on any device (to float rounding on a GPU)."""
    torch_threads: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    """torch intra-op threads, set by every stage. `auto`: one for a model under 20 M parameters (the demo's: one is
    fastest there); for a larger one the cores other work leaves idle when the command starts (SmolLM2-135M: 1.7x
    faster on 2 idle cores than on 1, far slower on 2 busy ones; rlhf_core.precision.resolve_threads)."""
    checkpoint_seconds: float = Field(60.0, ge=0)
    """Save mid-stage progress (reward-model and PPO epochs) at most this often; 0 saves every epoch.
    A crashed stage continues from its last save; short stages never pay for saving."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of every trained model: less memory, about a third more compute,
    the same results."""
    task_runner: Literal["local", "dask", "ray"] = "local"
    """Where the shards of sample_candidates, rollout, evaluate and reward-model labelling run: `local` (in the
    stage's own process, one after another), `dask` or `ray` (Prefect task runners, one task per shard)."""
    workers: int = Field(2, gt=0)
    """Worker processes of the local Dask cluster or Ray instance the pipeline starts and stops, when no
    `execution.address` is given."""
    address: str | None = None
    """An existing Dask scheduler (`tcp://HOST:8786`) or Ray cluster (`HOST:6379`, `ray://HOST:10001`) to run the
    shards on instead of a local one; its workers must see `run_root` and the model and data files at the same paths."""
    training_processes: int = Field(1, gt=0)
    """Processes that train the reward model and run the PPO update: 1 trains in the stage's own process; more
    run `accelerate launch` workers (DDP), each on its share of every minibatch."""
    accelerate_config: Path | None = None
    """An `accelerate config` file passed to `accelerate launch` (GPUs per node, GPU ids, ports); None launches
    `execution.training_processes` processes on this machine (gloo on CPUs, NCCL on GPUs). `distributed_type: FSDP`
    with `fsdp_config: {fsdp_version: 2}` shards the trained models' weights, gradients and optimizer states over
    the processes (FSDP2, full shard; `fsdp_transformer_layer_cls_to_wrap` names the layers, default the model's
    own); DeepSpeed and Megatron-LM are refused (docs/scaling.md)."""
    training_launcher: Literal["accelerate", "ray"] = "accelerate"
    """How the `execution.training_processes` processes start: `accelerate launch` on this machine, or `ray`: Ray
    Train workers (one CPU each, one GPU each with `execution.device` cuda) placed anywhere on the Ray cluster at
    `execution.address` (a local Ray without one), several machines included (docs/scaling.md). Either way
    `execution.accelerate_config`'s FSDP settings shard the models."""
    rendezvous_timeout: float = Field(300.0, gt=0)
    """Seconds the training processes may wait for each other (Ray: for room on the cluster for all of them)
    before the stage is refused in one line, instead of waiting for a node that never comes."""
    frozen_models_gb: float = Field(2.0, ge=0)
    """GiB of frozen models (the reference, the reward model, the actor an iteration samples with and
    evaluates) a process keeps in memory for its next stages instead of loading them again; 0 keeps none.
    They stay on the stages' device, so on a GPU this memory is not available to training: raise it where
    the GPU has room for the frozen models next to what the PPO update needs (docs/scaling.md)."""

    engine_url: str | None = None
    """With `sampling.engine: vllm`, a running generation engine server (`http://HOST:PORT`, started with
    `.venv-vllm/bin/python engine_server/server.py`, docs/engines.md) to sample on; None starts one for the command,
    stopped when it ends. Dask and Ray workers reach it at this URL."""
    engine_gpu_memory: float = Field(0.35, gt=0, le=0.95)
    """The share of the GPU's memory the generation engine the command starts takes (its weights and KV cache) on
    CUDA; the stages' own models share the GPU with it (vLLM's default, 0.9, would leave them nothing)."""
    engine_port: int = Field(0, ge=0, lt=65536)
    """The port of the generation engine the command starts (`sampling.engine: vllm`, no `engine_url`); 0 picks a
    free one."""
    engine_lora: Literal["auto", "merge", "request"] = "auto"
    """How the generation engine the command starts samples from a LoRA policy: `request` (vLLM's LoRA requests
    over the loaded base), `merge` (the adapter merged, in fp32, into a copy of the base weights, swapped in like a full
    model once per generation stage; only in an fp32 engine, `precision` fp32: a bf16 or fp16 weight cannot hold a LoRA
    update) or `auto`: merge on a CPU in fp32, where vLLM's LoRA kernels halved SmolLM2's tokens/s, requests elsewhere
    (bench/RESULTS.md section 8)."""
    engine_compile: bool = True
    """Compile the model of the generation engine the command starts (vLLM's default: torch.compile, and CUDA graphs
    on a GPU): a slower start for faster sampling. On this project's 2-core CPU, SmolLM2-135M sampled 22% more
    tokens/s compiled, for 75 s more at each start (bench/RESULTS.md section 8); `false` runs eager, for short
    commands."""

    @model_validator(mode="after")
    def _engine_is_installed(self) -> ExecutionConfig:
        package = {"dask": "prefect_dask", "ray": "prefect_ray"}.get(self.task_runner)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"`execution.task_runner` {self.task_runner} needs the package {package.replace('_', '-')}: "
                "pip install 'rlhf-pipeline[scale]'"
            )
        if self.accelerate_config is not None:
            sharding_of(self.accelerate_config, processes=self.training_processes)
        if self.training_launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "`execution.training_launcher` ray needs the package ray (Ray Train): pip install 'ray[train]'"
            )
        return self

    @property
    def sharding(self) -> Sharding | None:
        """How `accelerate_config` shards the trained models (None: data parallel, or no config)."""
        if self.accelerate_config is None:
            return None
        return sharding_of(self.accelerate_config, processes=self.training_processes)


def sharding_of(path: Path, *, processes: int) -> Sharding | None:
    """The sharding an accelerate config file asks for (None: data parallel), or a refusal naming the setting.

    Accelerate applies FSDP only on GPUs, so the training stages apply it themselves, on any device, from the
    file's `fsdp_config` (:func:`rlhf_core.distributed.shard_model`); everything else in the file goes to
    `accelerate launch` as it is.

    Raises:
        ValueError: the file is missing or not an accelerate config; it asks for FSDP1, a sharding strategy
            other than full shard (or ZeRO-2's `SHARD_GRAD_OP`), DeepSpeed or Megatron-LM; or it shards over
            one process.
    """
    if not path.is_file():
        raise ValueError(f"`execution.accelerate_config` {path} is not a file")
    try:
        settings = yaml.safe_load(path.read_text())  # accelerate writes YAML (or JSON, which YAML reads too)
    except yaml.YAMLError as error:
        raise ValueError(f"`execution.accelerate_config` {path} is not YAML or JSON: {error}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"`execution.accelerate_config` {path} is not an accelerate config (a mapping of settings)")
    distributed = str(settings.get("distributed_type", "NO")).upper()
    if distributed == "DEEPSPEED":
        installed = importlib.util.find_spec("deepspeed") is not None
        why = "" if installed else " (and the package deepspeed, GPUs only, is not installed)"
        raise ValueError(
            f"`execution.accelerate_config` {path} has distributed_type DEEPSPEED, which the training stages do not "
            f"drive{why}: use distributed_type FSDP with fsdp_config.fsdp_version 2 (the same sharding as ZeRO-3)"
        )
    if distributed not in ("FSDP",):
        if distributed in ("MEGATRON_LM", "XLA", "TP"):
            raise ValueError(
                f"`execution.accelerate_config` {path} has distributed_type {distributed}: the training stages "
                "support data parallel (MULTI_GPU, MULTI_CPU) and FSDP (fsdp_version 2) only"
            )
        return None
    fsdp = settings.get("fsdp_config") or {}
    if str(fsdp.get("fsdp_version", 1)) != "2":
        raise ValueError(
            f"`execution.accelerate_config` {path}: fsdp_config.fsdp_version must be 2 (FSDP2, `fully_shard`), got "
            f"{fsdp.get('fsdp_version', '1 (the default)')}"
        )
    reshard = fsdp.get("fsdp_reshard_after_forward", True)
    if isinstance(reshard, str):
        if reshard.upper() not in ("TRUE", "FALSE", "FULL_SHARD", "SHARD_GRAD_OP"):
            raise ValueError(
                f"`execution.accelerate_config` {path}: fsdp_config.fsdp_reshard_after_forward {reshard} is not "
                "supported; use true (FULL_SHARD) or false (SHARD_GRAD_OP)"
            )
        reshard = reshard.upper() in ("TRUE", "FULL_SHARD")
    if processes < 2:
        raise ValueError(
            f"`execution.accelerate_config` {path} shards the models (FSDP), which needs "
            f"`execution.training_processes` of 2 or more, got {processes}"
        )
    layers = fsdp.get("fsdp_transformer_layer_cls_to_wrap") or ()
    if isinstance(layers, str):
        layers = [name.strip() for name in layers.split(",") if name.strip()]
    return Sharding(layer_classes=tuple(layers), reshard_after_forward=bool(reshard))
