"""The RLHF flows: one iteration is seven stages; a campaign is N iterations.

Every stage is reused when its output for the same inputs already exists, so running a flow
again does no work, and a crashed run continues from its first unfinished stage.
"""

from __future__ import annotations

from prefect import flow

from flows.campaign import IterationState, close_iteration, open_iteration, resolve_base
from flows.config import PipelineConfig
from tasks import (
    collect_preferences,
    compute_advantages,
    evaluate,
    initialize,
    ppo_update,
    rollout,
    sample_candidates,
    train_reward_model,
)


@flow(name="rlhf-iteration")
def rlhf_iteration(config: PipelineConfig, iteration: int = 0, state: IterationState | None = None) -> IterationState:
    """One RLHF iteration; starts from the initial policy when ``state`` is None."""
    base = resolve_base(config)
    context = open_iteration(config, iteration, base, state)
    state = state or IterationState(policy=initialize(context).result())
    candidates = sample_candidates(context, state.policy).result()
    preferences = collect_preferences(context, candidates, state.reward_model).result()
    reward_model = train_reward_model(context, (*state.preferences, preferences), state.reward_model).result()
    experience = rollout(context, state.policy, reward_model).result()
    scored = compute_advantages(context, experience, reward_model).result()
    policy = ppo_update(context, state.policy, scored).result()
    evaluation = evaluate(context, policy, reward_model).result()
    stages = [candidates, preferences, reward_model, experience, scored, policy, evaluation]
    return close_iteration(context, stages, IterationState(policy, reward_model, (*state.preferences, preferences)))


@flow(name="rlhf-campaign")
def rlhf_campaign(config: PipelineConfig) -> IterationState:
    """``config.iterations`` iterations, each continuing from the previous one's policy and reward model."""
    state = None
    for iteration in range(config.iterations):
        state = rlhf_iteration(config, iteration, state)
    return state
