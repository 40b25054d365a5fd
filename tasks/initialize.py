"""Stage 0, initialize: the campaign's starting actor and critic, saved as the first policy state.

The actor is a copy of the base policy; the critic is the base backbone with a fresh value head
(the usual initialisation when no separate value model is given), made only for an estimator that
uses one (GAE). Both are trained weights, so both are fp32 whatever the precision (see
:mod:`rlhf_core.loading`).
"""

from __future__ import annotations

import torch

from storage.checkpoints import save_model
from storage.manifest import StageOutput
from tasks.context import StageContext
from tasks.stage import stage, stage_models
from tasks.text import load_tokenizer

STAGE = "initialize"


@stage(STAGE)
def initialize(out: StageOutput, context: StageContext, *, critic: bool) -> dict[str, float]:
    """Write ``actor/`` (and ``critic/`` when ``critic`` is set) for iteration 0 to start from."""
    models = stage_models(out, context, "fp32")
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", context.base.policy.path, trainable=True)
    save_model(out.path / "actor", actor, tokenizer)
    if critic:
        torch.manual_seed(context.stage_seed(STAGE))  # the value head's initialisation
        save_model(out.path / "critic", models.load("critic", context.base.policy.path, trainable=True), tokenizer)
    return {"actor_parameters": float(sum(p.numel() for p in actor.parameters()))}
