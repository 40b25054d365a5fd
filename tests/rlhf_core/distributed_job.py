"""The training of tests/rlhf_core/test_distributed.py, in the test's own process or in the test run's
``accelerate launch`` of 2 processes (tests/two_processes_job.py).

:func:`train_all`: every process builds the same tiny models and data from seeds (no dropout: each process would
draw its own masks), then trains, its models sharded over the processes (FSDP2) with ``shard``; the main process
saves the weights and statistics to ``OUT/<case>.pt``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import AdvantageConfig, PPOConfig, RewardModelConfig, SamplingConfig
from rlhf_core.distributed import Sharding, full_state_dict, prepare, shard_model
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.models import Critic, RewardModel, freeze
from rlhf_core.ppo import ppo_update
from rlhf_core.reward_training import PreferenceBatch, fit_reward_model
from runtime.models import accelerator_for
from tests.conftest import EOS, PAD, left_padded, tiny_config

TEMPERATURE = 0.7
PROMPTS = [[3, 4, 5], [6, 5], [9, 10, 11, 12], [13], [14, 15], [16, 17, 18], [19], [20, 21]]
PPO_CASES = {
    # 8 rollouts in minibatches of 7 and 1: the second gives one process no row (a stand-in of weight 0).
    "ppo_token_mean": PPOConfig(epochs=2, minibatch_size=7, actor_learning_rate=1e-3, critic_learning_rate=1e-3),
    "ppo_sequence_mean_entropy_kl": PPOConfig(
        epochs=2,
        minibatch_size=3,
        aggregation="sequence_mean",
        entropy_coef=0.01,
        kl_loss_coef=0.1,
        actor_learning_rate=1e-3,
        critic_learning_rate=1e-3,
    ),  # fmt: skip
    "ppo_target_kl": PPOConfig(epochs=8, minibatch_size=4, target_kl=2e-3, actor_learning_rate=3e-3),
    # Stops before its fifth step: the first four minibatches measure under 0.4 nats, the fifth over 0.7.
    "ppo_kl_budget": PPOConfig(epochs=8, minibatch_size=4, kl_budget=0.5, actor_learning_rate=3e-3),
}
SHARDED_CASES = {
    # (architecture, LoRA, gradient checkpointing): the sharded runs (--shard) also train these, one process too.
    "ppo_llama_lora": ("llama", True, False),
    "ppo_llama_checkpointing": ("llama", False, True),
}
"""PPO updates (the first case's settings) of other model families, with LoRA or gradient checkpointing."""


def _config(arch: str = "gpt2"):
    config = tiny_config(arch)
    if arch == "gpt2":
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return config


def _trained(model: torch.nn.Module, *, lora: bool, checkpointing: bool) -> torch.nn.Module:
    """``model`` with LoRA adapters (all linear layers; the head of a critic trained too) and checkpointing."""
    if checkpointing:
        backbone = model.model if isinstance(model, Critic | RewardModel) else model
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if not lora:
        return model
    import peft

    adapters = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    if isinstance(model, Critic | RewardModel):
        wrapped = type(model).wrap(peft.get_peft_model(model.model, adapters), model.head)
        wrapped.head.requires_grad_(True)
        return wrapped
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights (gathered on the main process when sharded: every process calls this)."""
    return {key: value.detach().clone() for key, value in full_state_dict(model).items()}


def run_ppo(
    name: str, config: PPOConfig, out: Path, *, shard: bool, arch: str = "gpt2", lora: bool = False,
    checkpointing: bool = False,
) -> None:  # fmt: skip
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(_config(arch))
    critic = Critic(config=_config(arch))
    torch.manual_seed(1)
    reference = freeze(AutoModelForCausalLM.from_config(_config(arch)))
    maker = ExperienceMaker(
        actor,
        critic,
        lambda sequences, mask: ((sequences == 7) & mask.bool()).float().sum(dim=1),
        reference,
        sampling=SamplingConfig(max_new_tokens=6, temperature=TEMPERATURE),
        eos_token_id=EOS,
        pad_token_id=PAD,
        precision="fp32",
    )
    ids, mask = left_padded(PROMPTS)
    experience = maker.make_experience(ids, mask, generator=torch.Generator().manual_seed(0))
    scored = score_experience(experience, AdvantageConfig(kl_coef=0.05, normalize_scores=False))
    torch.manual_seed(2)  # the adapters' initialisation
    models = [_trained(model, lora=lora, checkpointing=checkpointing) for model in (actor, critic)]
    if shard:
        models = [shard_model(model, Sharding()) for model in models]
    optimizers = [
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=rate)
        for model, rate in zip(models, (config.actor_learning_rate, config.critic_learning_rate), strict=True)
    ]
    (actor, critic), optimizers = prepare(accelerator, models, optimizers)
    stats = ppo_update(
        actor, critic, *optimizers, scored, config, accelerator=accelerator, temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    weights = {
        role: _weights(accelerator.unwrap_model(model)) for role, model in (("actor", actor), ("critic", critic))
    }
    if accelerator.is_main_process:
        torch.save({"weights": weights, "stats": stats._asdict()}, out / f"{name}.pt")


def run_reward_model(
    out: Path, *, shard: bool, name: str = "reward_model", arch: str = "gpt2", lora: bool = False
) -> None:
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    torch.manual_seed(0)
    model = RewardModel(config=_config(arch))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (2, 13, 9), generator=generator)  # 13 pairs of 9 tokens
    mask = torch.ones_like(ids)
    mask[:, ::3, :2] = 0  # some left padding
    margin = torch.rand(13, generator=generator)
    pairs = PreferenceBatch(ids[0], mask[0], ids[1], mask[1], margin)
    # SGD, not Adam: a shift common to chosen and rejected (the head's bias, the final norm's bias) cancels in the
    # Bradley-Terry loss, so those parameters' gradients are float noise, which Adam would scale up to full steps.
    torch.manual_seed(2)
    model = _trained(model, lora=lora, checkpointing=False)
    if shard:
        model = shard_model(model, Sharding())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    (model,), (optimizer,) = prepare(accelerator, [model], [optimizer])
    # 11 training pairs in minibatches of 4, 4 and 3 (shares 2/2, 2/2, 2/1).
    config = RewardModelConfig(epochs=2, batch_size=4, learning_rate=1e-3)
    stats = fit_reward_model(
        model, optimizer, pairs.select(torch.arange(11)), pairs.select(torch.arange(11, 13)), config,
        accelerator=accelerator, generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    weights = _weights(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        torch.save({"weights": {"reward_model": weights}, "stats": stats._asdict()}, out / f"{name}.pt")


def train_all(out: Path, *, shard: bool, sharded_cases: bool) -> None:
    """Every PPO case and the reward model into ``out``; with ``sharded_cases`` (always with ``shard``) the other
    model families' cases too."""
    out.mkdir(parents=True, exist_ok=True)
    for case, ppo in PPO_CASES.items():
        run_ppo(case, ppo, out, shard=shard)
    run_reward_model(out, shard=shard)
    if shard or sharded_cases:
        first = next(iter(PPO_CASES.values()))
        for case, (arch, lora, checkpointing) in SHARDED_CASES.items():
            run_ppo(case, first, out, shard=shard, arch=arch, lora=lora, checkpointing=checkpointing)
        run_reward_model(out, shard=shard, name="reward_model_llama_lora", arch="llama", lora=True)
