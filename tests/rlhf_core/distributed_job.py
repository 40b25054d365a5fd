"""The training of tests/rlhf_core/test_distributed.py, run alone (one process) or under ``accelerate launch``.

Every process builds the same tiny models and data from seeds (no dropout: each process would draw its
own masks), then trains; the main process saves the weights and statistics to ``OUT/<case>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM

from rlhf_core.config import AdvantageConfig, PPOConfig, RewardModelConfig, SamplingConfig
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.loading import ModelLoader
from rlhf_core.models import Critic, RewardModel, freeze
from rlhf_core.ppo import ppo_update
from rlhf_core.reward_training import PreferenceBatch, fit_reward_model
from tasks.train_worker import leave_process_group
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
}


def _config():
    config = tiny_config("gpt2")
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return config


def run_ppo(name: str, config: PPOConfig, out: Path) -> None:
    accelerator = ModelLoader(device=torch.device("cpu"), precision="fp32").accelerator()
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(_config())
    critic = Critic(config=_config())
    torch.manual_seed(1)
    reference = freeze(AutoModelForCausalLM.from_config(_config()))
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
    optimizers = [
        torch.optim.AdamW(actor.parameters(), lr=config.actor_learning_rate),
        torch.optim.AdamW(critic.parameters(), lr=config.critic_learning_rate),
    ]
    actor, critic, *optimizers = accelerator.prepare(actor, critic, *optimizers)
    stats = ppo_update(
        actor, critic, *optimizers, scored, config, accelerator=accelerator, temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    if accelerator.is_main_process:
        weights = {
            role: {key: value.detach().clone() for key, value in accelerator.unwrap_model(model).state_dict().items()}
            for role, model in (("actor", actor), ("critic", critic))
        }
        torch.save({"weights": weights, "stats": stats._asdict()}, out / f"{name}.pt")


def run_reward_model(out: Path) -> None:
    accelerator = ModelLoader(device=torch.device("cpu"), precision="fp32").accelerator()
    torch.manual_seed(0)
    model = RewardModel(config=_config())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (2, 13, 9), generator=generator)  # 13 pairs of 9 tokens
    mask = torch.ones_like(ids)
    mask[:, ::3, :2] = 0  # some left padding
    margin = torch.rand(13, generator=generator)
    pairs = PreferenceBatch(ids[0], mask[0], ids[1], mask[1], margin)
    # SGD, not Adam: a shift common to chosen and rejected (the head's bias, the final norm's bias) cancels in the
    # Bradley-Terry loss, so those parameters' gradients are float noise, which Adam would scale up to full steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    # 11 training pairs in minibatches of 4, 4 and 3 (shares 2/2, 2/2, 2/1).
    config = RewardModelConfig(epochs=2, batch_size=4, learning_rate=1e-3)
    stats = fit_reward_model(
        model, optimizer, pairs.select(torch.arange(11)), pairs.select(torch.arange(11, 13)), config,
        accelerator=accelerator, generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    if accelerator.is_main_process:
        weights = {key: value.detach().clone() for key, value in accelerator.unwrap_model(model).state_dict().items()}
        torch.save({"weights": {"reward_model": weights}, "stats": stats._asdict()}, out / "reward_model.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1])
    for case, ppo in PPO_CASES.items():
        run_ppo(case, ppo, target)
    run_reward_model(target)
    leave_process_group(PartialState())  # or a process may abort at exit, failing a run that succeeded
