"""Stage 0, initialize: the campaign's starting actor and critic, saved as the first policy state.

The actor is the base policy. The critic, made only for an estimator that uses one (GAE), is the
policy's backbone with a fresh value head (the usual initialisation when no separate value model is
given), or, with ``critic_init: reward_model``, a pretrained reward model's backbone with its score
head as the value head (OpenRLHF and verl start the critic from the reward model). Neither copies a
base's weights: with full fine-tuning the folders refer to the base (the critic adds its head); with
LoRA they hold fresh adapters (which change nothing until trained).
"""

from __future__ import annotations

import torch

from rlhf_core.config import LoraConfig
from runtime.context import StageContext
from runtime.stage import stage, stage_models
from storage.checkpoints import save_model
from storage.manifest import StageOutput
from tasks.text import load_tokenizer

STAGE = "initialize"


@stage(STAGE)
def initialize(
    out: StageOutput, context: StageContext, *, critic: bool, lora: LoraConfig | None, critic_init: str
) -> dict[str, float]:
    """Write ``actor/`` (and ``critic/`` when ``critic`` is set) for iteration 0 to start from.

    Args:
        critic: make a critic (an estimator that uses one: GAE).
        critic_init: ``policy`` or ``reward_model``: the base the critic starts from.
    """
    models = stage_models(out, context, "fp32", lora=lora)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    torch.manual_seed(context.stage_seed(STAGE))  # fresh adapters and the value head
    actor = models.load("actor", context.base.policy.path, trainable=True)
    save_model(out.path / "actor", actor, tokenizer, weights=False)
    if critic:
        value_model = models.load("critic", context.base.bases[critic_init], trainable=True)
        save_model(out.path / "critic", value_model, tokenizer, weights=False)
    return {
        "actor_parameters": float(sum(p.numel() for p in actor.parameters())),
        "trained_parameters": float(sum(p.numel() for p in actor.parameters() if p.requires_grad)),
    }
