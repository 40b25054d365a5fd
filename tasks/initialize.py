"""Stage 0, initialize: the campaign's starting actor and critic, saved as the first policy state.

The actor is a copy of the base policy; the critic is the base backbone with a fresh value head
(the usual initialisation when no separate value model is given).
"""

from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rlhf_core.models import Critic
from storage.checkpoints import load_causal_lm, save_model
from storage.manifest import StageOutput
from tasks.runtime import IterationContext, run_stage, stage_state
from tasks.text import load_tokenizer

STAGE = "initialize"


@task(name=STAGE, cache_policy=NO_CACHE)
def initialize(context: IterationContext) -> State:
    """Write ``actor/`` and ``critic/`` for iteration 0 to start from."""

    def produce(out: StageOutput) -> dict[str, float]:
        torch.manual_seed(context.seed(STAGE))
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        actor = load_causal_lm(context.base.policy_dir)
        save_model(out.path / "actor", actor, tokenizer)
        save_model(out.path / "critic", Critic.from_pretrained(context.base.policy_dir), tokenizer)
        return {"actor_parameters": float(sum(p.numel() for p in actor.parameters()))}

    return stage_state(run_stage(context, STAGE, config={"seed": context.config.seed}, upstream={}, produce=produce))
