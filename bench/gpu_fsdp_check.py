"""An FSDP2 PPO update in bf16 on one CUDA GPU, beside the same update unsharded: wall time, peak memory, agreement.

    PYTHONPATH=. python bench/gpu_fsdp_check.py --lora     # about 1 minute on an H100 or H200

Self-contained: only ``rlhf_core`` with torch, transformers and accelerate (no Prefect, MLflow, polars, pyarrow or
hub downloads). A Llama-shaped actor and critic (``--layers``, ``--hidden``; about 0.5 B parameters each by default)
are built from seeds on the GPU; one rollout (HF generation through ``rlhf_core``) gives the experience; then:

1. the plain update: ``accelerator.prepare`` (one process, bf16 autocast, fp32 master weights), as the
   pipeline's one-process ``ppo_update`` trains;
2. the sharded update: the same models from the same seeds, sharded by :func:`rlhf_core.distributed.shard_model`
   (FSDP2 ``fully_shard`` on a process group of this one GPU, NCCL), prepared by
   :func:`rlhf_core.distributed.prepare`, their weights gathered by :func:`rlhf_core.distributed.full_state_dict`.

It prints each update's wall time and peak CUDA memory, and the largest weight difference between them relative to
the largest weight change of the plain update (a sharded update that trained differently shows as a ratio near 1 or
more; float rounding stays far below). It exits 1 when that ratio exceeds ``--tolerance``. With one GPU the shards
are the whole model (world size 1): the check is that the sharded code path runs on CUDA in bf16 and computes the
plain update; the memory drop with N GPUs is measured on CPU processes in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig

from rlhf_core.config import AdvantageConfig, PPOConfig, SamplingConfig
from rlhf_core.distributed import Sharding, full_state_dict, prepare, shard_model
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.models import Critic, freeze
from rlhf_core.ppo import ppo_update

PAD, EOS = 0, 2


def _models(config: LlamaConfig, device: torch.device, *, lora: bool = False) -> tuple[torch.nn.Module, ...]:
    """Actor and critic, the same weights for every call (seeded), fp32 on ``device``; with ``lora``, as the model
    seam trains them under LoRA: a frozen bf16 base plus fp32 adapters (every linear layer, r = 16) and an fp32
    critic head."""
    torch.manual_seed(0)
    with device:
        actor, critic = AutoModelForCausalLM.from_config(config), Critic(config=config)
    if not lora:
        return actor, critic
    import peft

    def adapters():  # peft writes the modules it found into the config: one config per model
        return peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")

    torch.manual_seed(1)
    actor = peft.get_peft_model(actor.to(torch.bfloat16), adapters())
    backbone = peft.get_peft_model(critic.model.to(torch.bfloat16), adapters())
    critic = Critic.wrap(backbone, critic.head)
    critic.head.requires_grad_(True)
    return actor, critic


def _experience(config: LlamaConfig, device: torch.device, *, rollouts: int, prompt: int, response: int):
    """One rollout of the seeded actor, scored (GAE): the experience both updates train on."""
    actor, critic = _models(config, device)
    reference = actor  # the first update's reference is its initial actor
    maker = ExperienceMaker(
        freeze(actor), freeze(critic), lambda ids, mask: (ids % 7 == 3).float().sum(1) / ids.shape[1], reference,
        sampling=SamplingConfig(max_new_tokens=response, temperature=1.0), eos_token_id=EOS, pad_token_id=PAD,
        precision="bf16",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (rollouts, prompt), generator=generator).to(device)
    experience = maker.make_experience(ids, torch.ones_like(ids), generator=generator)
    return score_experience(experience, AdvantageConfig(kl_coef=0.05))


def _weights(models: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every model's whole state (gathered where sharded), fp32 on the CPU, as ``role.name``."""
    return {
        f"{role}.{name}": value.detach().float().cpu()
        for role, model in models.items()
        for name, value in full_state_dict(model).items()
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _update(config: LlamaConfig, experience, ppo: PPOConfig, device: torch.device, *, shard: bool, lora: bool) -> dict:
    """One PPO update; prints its wall seconds and peak memory; returns the trained weights (on the CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    accelerator = Accelerator(mixed_precision="bf16", cpu=not cuda)
    models = list(_models(config, device, lora=lora))
    if shard:
        models = [shard_model(model, Sharding()) for model in models]
    optimizers = [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5) for model in models]
    (actor, critic), optimizers = prepare(accelerator, models, optimizers)
    _synchronize(device)
    started = time.perf_counter()
    stats = ppo_update(
        actor, critic, *optimizers, experience, ppo, accelerator=accelerator, temperature=1.0,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    _synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else float("nan")
    weights = _weights({"actor": actor, "critic": critic})
    print(  # noqa: T201
        f"{'FSDP2' if shard else 'plain'}{' LoRA' if lora else ''} update: {seconds:.2f} s, peak {peak:.0f} MiB, {stats.optimizer_steps} steps, "
        f"policy_loss {float(stats.policy_loss):.5f}, approx_kl {float(stats.approx_kl):.3g}"
    )
    del actor, critic, optimizers, models
    return weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--lora", action="store_true", help="also the LoRA update (bf16 base, fp32 adapters)")
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke run on the CPU (gloo), e.g. --layers 2 --hidden 128"
    )
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_fsdp_check: no CUDA device (--cpu for a smoke run)", file=sys.stderr)  # noqa: T201
        return 2
    device = torch.device("cpu" if args.cpu else "cuda:0")
    if not args.cpu:
        torch.cuda.set_device(device)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = "gloo" if args.cpu else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
        max_position_embeddings=1024, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    name = "CPU" if args.cpu else torch.cuda.get_device_name(device)
    print(  # noqa: T201
        f"{name}; torch {torch.__version__}; Llama {args.layers} layers x {args.hidden}: "
        f"{parameters / 1e9:.2f} B parameters per model (actor and critic, full fine-tuning, bf16 autocast)"
    )
    started = time.perf_counter()
    experience = _experience(config, device, rollouts=args.rollouts, prompt=32, response=args.response)
    print(f"rollout: {args.rollouts} x {args.response} tokens in {time.perf_counter() - started:.1f} s")  # noqa: T201
    ppo = PPOConfig(epochs=2, minibatch_size=args.rollouts // 4)
    agree = all(
        _compare(config, experience, ppo, device, lora=lora, tolerance=args.tolerance)
        for lora in ((False, True) if args.lora else (False,))
    )
    dist.destroy_process_group()
    return 0 if agree else 1


def _compare(config, experience, ppo: PPOConfig, device: torch.device, *, lora: bool, tolerance: float) -> bool:
    """The plain and the sharded update from the same models; whether their weights agree."""
    initial = _weights(dict(zip(("actor", "critic"), _models(config, device, lora=lora), strict=True)))
    plain = _update(config, experience, ppo, device, shard=False, lora=lora)
    sharded = _update(config, experience, ppo, device, shard=True, lora=lora)
    assert plain.keys() == sharded.keys() == initial.keys(), "the sharded update's state dict has other keys"
    change = max((plain[name] - initial[name]).abs().max().item() for name in plain)
    difference = max((plain[name] - sharded[name]).abs().max().item() for name in plain)
    ratio = difference / change if change > 0 else float("inf")
    print(  # noqa: T201
        f"largest weight change of the plain update {change:.3g}; largest plain - FSDP2 difference {difference:.3g} "
        f"({ratio:.3f} of the change; tolerance {tolerance}): {'OK' if ratio <= tolerance else 'MISMATCH'}"
    )
    return ratio <= tolerance


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
