"""Stage 0, initialize: the campaign's starting actor and critic, saved as the first policy state.

The actor is the base policy. The critic, made only for an estimator that uses one (GAE), is the
policy's backbone with a fresh value head (the usual initialisation when no separate value model is
given), or, with ``critic_init: reward_model``, a pretrained reward model's backbone with its score
head as the value head (OpenRLHF and verl start the critic from the reward model). Neither copies a
base's weights: with full fine-tuning the folders refer to the base (the critic adds its head); with
LoRA they hold fresh adapters (which change nothing until trained). With ``critic_init: reward_model`` and no
pretrained reward model the critic starts from the first one the campaign trains: there is none yet, so the
start has no critic, and iteration 0's rollout and update take that reward model as the critic.
"""

from __future__ import annotations

import torch

from runtime.job import Job
from runtime.stage import Stage
from storage.checkpoints import save_model
from tasks.settings import InitializeSettings
from tasks.text import load_tokenizer


def work(job: Job[InitializeSettings]) -> dict[str, float]:
    """Write ``actor/`` (and ``critic/`` when the estimator uses one) for iteration 0 to start from."""
    settings, base = job.settings, job.context.base
    models = job.models("fp32", lora=settings.lora)
    tokenizer = load_tokenizer(base.tokenizer.path)
    torch.manual_seed(job.seed())  # fresh adapters and the value head
    actor = models.load("actor", base.policy.path, trainable=True)
    save_model(job.out.path / "actor", actor, tokenizer, weights=False)
    if settings.critic and settings.critic_init in base.bases:  # else it starts from the first trained reward model
        value_model = models.load("critic", base.bases[settings.critic_init], trainable=True)
        save_model(job.out.path / "critic", value_model, tokenizer, weights=False)
    return {
        "actor_parameters": float(sum(p.numel() for p in actor.parameters())),
        "trained_parameters": float(sum(p.numel() for p in actor.parameters() if p.requires_grad)),
    }


initialize = Stage(InitializeSettings, work=work)
