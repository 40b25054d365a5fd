"""The RLHF flows: one iteration is seven stages (four with a reward function, which needs no candidates,
labels or reward model; eight where an overlapped rollout's values came from an older policy's critic, which the
update's starting critic values again; with `update: dpo`, candidates, labels, the reference's log-probs of the pairs
and a DPO update, then evaluation); a campaign is N iterations; a replay re-runs stages 5-7 of a recorded iteration
from its saved experience (a DPO iteration's update and evaluation, from its stored pairs) with new settings.

A campaign's finished iterations are history (:mod:`campaign.history`): running it again continues from its first
unfinished iteration, whatever code or inputs changed. Within an iteration, every stage is reused when its output
for the same inputs (and the same code that computes it) already exists, so a crashed run continues from its
first unfinished stage. Each stage gets exactly the settings it declares (:mod:`tasks.settings`), read from the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from campaign.config import PipelineConfig
from campaign.history import STAGE_MODULES, check_from_iteration, finished_iterations, what_differs
from flows.concurrency import campaign_slot
from flows.heap import iteration_starting
from flows.human_labels import request_human_labels
from flows.iterations import (
    Front,
    IterationState,
    ReplayInputs,
    campaign_layout,
    close_iteration,
    finished_state,
    generation_engine,
    load_latest_state,
    load_replay_inputs,
    open_iteration,
    open_replay,
    resolve_base,
    sft_output,
    supervised_base,
)
from flows.overlap import ahead_of, beside, lanes, runs_ahead
from flows.replay import check_replay_data, check_replayable
from flows.rounds import Round, round_metrics, round_stages, shortfall, wants_another_round
from rlhf_core.precision import resolve_device
from runtime.cluster import cluster
from runtime.code import pinned_code
from runtime.concurrency import gpu_stages
from runtime.context import BaseInputs, StageContext
from runtime.declaration import StageResult
from runtime.engine import engine_identity
from runtime.events import ITERATION_EVENT, STAGE_EVENT, announces_failure
from runtime.launch import warm_up
from runtime.records import upstream_result
from storage.locks import exclusive_lock
from tasks.collect_preferences import collect_preferences
from tasks.compute_advantages import compute_advantages
from tasks.critic_values import critic_values
from tasks.dpo_update import dpo_update
from tasks.evaluate import evaluate
from tasks.initialize import initialize
from tasks.ppo_update import optimizer_state, ppo_update
from tasks.reference_logprobs import reference_logprobs
from tasks.rollout import rollout
from tasks.sample_candidates import sample_candidates
from tasks.sample_reference import sample_reference
from tasks.train_reward_model import train_reward_model


def _iteration_run_name() -> str:
    """``<campaign>-iteration-N`` (``-next`` when it continues from the latest, until :func:`_name_iteration_run`
    knows N): the Prefect UI's flow run name."""
    parameters = flow_run.parameters
    iteration = parameters.get("iteration")
    return f"{_campaign(parameters)}-iteration-{'next' if iteration is None else iteration}"


def _name_iteration_run(campaign: str, iteration: int) -> None:
    """Rename this flow run ``<campaign>-iteration-N`` once an iteration started without a number (a schedule's, a
    deployment's) knows which it continues with, so the Prefect UI's run list tells them apart."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=f"{campaign}-iteration-{iteration}")


def _replay_run_name() -> str:
    return f"{_campaign(flow_run.parameters)}-replay-of-{flow_run.parameters['source_run_id'][:12]}"


def _campaign_run_name() -> str:
    return f"{_campaign(flow_run.parameters)}-campaign"


def _campaign(parameters: dict) -> str:
    config = parameters["config"]
    return config.campaign if isinstance(config, PipelineConfig) else config["campaign"]


@flow(name="rlhf-iteration", flow_run_name=_iteration_run_name)
def rlhf_iteration(
    config: PipelineConfig,
    iteration: int | None = None,
    state: IterationState | None = None,
    fresh: bool = False,
    base: BaseInputs | None = None,
    ahead: bool = False,
) -> IterationState:
    """One RLHF iteration. Without ``iteration``, continues the campaign from its latest finished iteration.
    With ``fresh``, a finished run of the same inputs is recomputed in a new run, which supersedes it. ``base``:
    the base inputs the command resolved already (:func:`flows.iterations.resolve_base`), or None to resolve them.
    With ``ahead`` and ``sampling.staleness`` >= 1, the next iteration's generation stages run beside this one's
    update (:mod:`flows.overlap`).

    Holds the campaign's lock file and the slot of its Prefect global concurrency limit throughout, so two
    iterations of one campaign never run at once, on one machine or several; on a GPU its stages carry the ``gpu``
    tag (:func:`runtime.concurrency.gpu_stages`), so other campaigns' GPU stages take turns with them; runs on the
    cluster of ``config.execution`` (:mod:`runtime.cluster`) and the generation engine
    (:func:`flows.iterations.generation_engine`). If it fails, its MLflow run ends FAILED (KILLED on Ctrl-C); running
    it again reopens and finishes it.
    """
    iteration_starting()  # the second in a process freezes its long-lived objects out of full collections
    layout = campaign_layout(config)
    with (
        pinned_code(STAGE_MODULES),  # the code this run computes with is the code it keys by (runtime.code)
        exclusive_lock(layout.lock_file()),
        campaign_slot(config.campaign, layout.slot_file()),
        cluster(config.execution),
    ):
        base = supervised_base(config, base or resolve_base(config))
        if iteration is None:
            iteration, state = load_latest_state(config, base)
            _name_iteration_run(config.campaign, iteration)
        context = open_iteration(config, iteration, base, state, fresh=fresh)
        get_run_logger().info(
            "iteration %d of campaign %s",
            iteration,
            config.campaign,
            extra={STAGE_EVENT: "iteration", ITERATION_EVENT: iteration},
        )
        with (
            context.tracker.ends_on_error(context.parent_run_id),
            announces_failure(
                config.campaign, _failure_payload(context, "iteration", None if state is None else state.policy)
            ),
            gpu_stages(resolve_device(config.execution.device).type, campaign=config.campaign),
        ):
            return _iteration(config, context, state, ahead=ahead)


def _failure_payload(context: StageContext, kind: str, policy: StageResult | None) -> dict:
    """What the event of a failed iteration or replay says besides the error: which run, from which policy."""
    return {
        "iteration": context.iteration,
        "kind": kind,
        "iteration_run_id": context.parent_run_id,
        "flow_run_id": context.flow_run_id,
        "policy_digest": None if policy is None else policy.digest,
    }


def _iteration(
    config: PipelineConfig, context: StageContext, state: IterationState | None, *, ahead: bool
) -> IterationState:
    opening: list[StageResult] = []
    if state is None:  # iteration 0 starts the campaign
        opening, policy = _start(config, context)
        state = IterationState(policy=policy)
    learn = _dpo_steps if config.update == "dpo" else _ppo_steps  # a DPO update: no reward model, rollout, advantages
    stages, new_state = learn(config, context, state, ahead=ahead)
    evaluation = _evaluation(config, context, new_state.policy, new_state.reward_model)
    stages = [*opening, *stages, *evaluation]
    return close_iteration(context, stages, new_state, metrics=round_metrics(stages, config.sizes))


def _start(config: PipelineConfig, context: StageContext) -> tuple[list[StageResult], StageResult]:
    """The campaign's initial policy: the pretrained one, or with ``sft.data`` the SFT output (which ran, or was
    reused, before the iteration opened: :func:`flows.iterations.supervised_base`), named as the actor's upstream;
    and the SFT output as a stage of iteration 0, whose run then shows its metrics (``sft/...``) and names it."""
    sft = sft_output(context)
    return ([] if sft is None else [sft]), initialize(context, config, sft=sft)


def _ppo_steps(
    config: PipelineConfig, context: StageContext, state: IterationState, *, ahead: bool
) -> tuple[list[StageResult], IterationState]:
    """Stages 1-6 of an RL iteration: candidates, labels and the reward model, the rollout, (where it sampled an older
    policy than the update starts from, the update's critic's values of its rows,) advantages and the PPO update; with
    ``ahead``, the next iteration's generation stages beside the update (:mod:`flows.overlap`)."""
    staleness = config.sampling.staleness
    sampling, training = lanes(context, config)
    warm_up(training.execution)  # an update of its own process imports its code while the generation stages run
    origin = _critic_origin(config, context, state)
    front = _front(config, sampling, state.sampler(staleness), state.reward_model, state.preferences, origin)
    critic_start = _critic_start(config, state.policy, front.reward_model)
    values = _critic_values(config, training, state, front.experience, critic_start)
    scored = compute_advantages(
        training,
        config,
        experience=front.experience,
        critic_values=values,
        reward_model=front.reward_model,
        previous=state.advantages,
    )
    update = {
        "policy": state.policy,
        "optimizer": optimizer_state(state.policy),
        "scored": scored,
        "critic_start": critic_start,
    }
    if ahead and runs_ahead(config):  # the next iteration's generation beside this update (flows.overlap)
        next_sampler = state.sampler(staleness - 1)
        next_origin = update["critic_start"] or origin
        next_front = partial(
            _front, config, ahead_of(sampling), next_sampler, front.reward_model, front.preferences, next_origin
        )
        policy = beside(ppo_update.submit(training, config, **update), next_front)
    else:
        policy = ppo_update(training, config, **update)
    new_state = state.after(
        policy, staleness=staleness, reward_model=front.reward_model, preferences=front.preferences, advantages=scored
    )
    return [*front.stages, *filter(None, [values]), scored, policy], new_state


def _dpo_steps(
    config: PipelineConfig, context: StageContext, state: IterationState, *, ahead: bool
) -> tuple[list[StageResult], IterationState]:
    """The steps of a DPO iteration (``update: dpo``): candidates and their labels, the reference's log-probs of the
    pairs, and the DPO update on them. Nothing runs ahead (a DPO campaign has no staleness).

    Offline DPO (labeler ``import``) samples nothing: the imported pairs and the reference's log-probs of them are
    iteration 0's, once per campaign (as the reference's samples are), and every iteration trains on them again from
    the policy the one before made."""
    pairs_context = replace(context, iteration=0) if config.labeler == "import" else context
    rounds = _collect(config, pairs_context, state.policy, None)
    pairs = reference_logprobs(pairs_context, config, preferences=tuple(step.preferences for step in rounds))
    policy = dpo_update(context, config, policy=state.policy, pairs=pairs)
    return [*round_stages(rounds), pairs, policy], state.after(policy, staleness=0)


def _evaluation(
    config: PipelineConfig, context: StageContext, policy: StageResult, reward_model: StageResult | None
) -> list[StageResult]:
    """The reference's samples (once per campaign) and stage 7, the evaluation of ``policy`` (on held-out episodes
    with an environment: docs/environments.md)."""
    reference = sample_reference(replace(context, iteration=0), config)
    return [reference, evaluate(context, config, policy=policy, reward_model=reward_model, reference=reference)]


def _critic_start(config: PipelineConfig, policy: StageResult, reward_model: StageResult | None) -> StageResult | None:
    """The reward model the critic starts from while ``policy`` is the campaign's start, which has none
    (``PipelineConfig.critic_from_trained_reward_model``); None once a PPO update has made the critic."""
    return reward_model if config.critic_from_trained_reward_model and policy.stage == "initialize" else None


def _critic_values(
    config: PipelineConfig,
    context: StageContext,
    state: IterationState,
    experience: StageResult,
    critic_start: StageResult | None,
) -> StageResult | None:
    """The values of the critic the update starts from (``state.policy``'s, or ``critic_start``) for the rows of the
    rollout ``experience``, where the rollout took its values from another critic: with ``sampling.staleness`` >= 1
    after iteration 0 it sampled an older policy and scored with that policy's critic (:mod:`tasks.critic_values`).
    None where it sampled the policy the update starts from (its critic is the update's) or the estimator uses no
    critic."""
    sampler = state.sampler(config.sampling.staleness)
    if not config.advantages.uses_critic or sampler.digest == state.policy.digest:
        return None
    return critic_values(context, config, experience=experience, policy=state.policy, critic_start=critic_start)


def _critic_origin(config: PipelineConfig, context: StageContext, state: IterationState) -> StageResult | None:
    """The reward model the campaign's critic started from, once iteration 0's update has started it; None before,
    and for a critic that does not start from a trained reward model."""
    chain = (*state.earlier, state.policy)
    if not config.critic_from_trained_reward_model or len(chain) < 2 or chain[0].stage != "initialize":
        return None
    return upstream_result(context, chain[1], "critic_start")  # chain[1]: iteration 0's update


def _front(
    config: PipelineConfig,
    context: StageContext,
    sampler: StageResult,
    reward_model: StageResult | None,
    preferences: tuple[StageResult, ...],
    critic_origin: StageResult | None = None,
) -> Front:
    """Stages 1-4, the generation side: candidates and their labels from the ``sampler`` policy, the reward model
    trained on every pair so far (continuing ``reward_model``), and the rollout of ``sampler``.

    A rollout of the campaign's initial policy takes its values from a critic started from ``critic_origin``, the
    reward model iteration 0's update started its critic from (:func:`_critic_origin`), or in iteration 0 from the
    reward model trained here: with ``sampling.staleness`` >= 1 a later iteration still samples the initial policy,
    and its values come from the critic the update trains, not from one started from a newer reward model."""
    learned: list[StageResult] = []
    if config.reward.source == "reward_model":
        rounds = _collect(config, context, sampler, reward_model) if config.reward_model.train else ()
        preferences = (*preferences, *(step.preferences for step in rounds))
        reward_model = train_reward_model(context, config, preferences=preferences, previous=reward_model)
        learned = [*round_stages(rounds), reward_model]
    critic_start = _critic_start(config, sampler, critic_origin or reward_model)
    experience = rollout(context, config, policy=sampler, reward_model=reward_model, critic_start=critic_start)
    return Front((*learned, experience), reward_model, preferences, experience)


def _collect(
    config: PipelineConfig, context: StageContext, sampler: StageResult, reward_model: StageResult | None
) -> tuple[Round, ...]:
    """Stages 1 and 2, in rounds until the iteration has ``sizes.decisive_pairs`` (:mod:`flows.rounds`; one round
    without it): candidates from the ``sampler`` policy (none for imported pairs: nothing would read them), and their
    preference labels (by the previous ``reward_model`` with labeler reward_model)."""
    if config.labeler == "import":
        preferences = collect_preferences(context, config, candidates=None, reward_model=None, labels=None, earlier=())
        return (Round(None, preferences),)
    rounds: list[Round] = []
    while wants_another_round(rounds, config.sizes):
        rounds.append(_round(config, context, sampler, reward_model, earlier=rounds))
    if note := shortfall(rounds, config.sizes):
        get_run_logger().info("iteration %d: %s", context.iteration, note, extra={STAGE_EVENT: "notice"})
    return tuple(rounds)


def _round(
    config: PipelineConfig,
    context: StageContext,
    sampler: StageResult,
    reward_model: StageResult | None,
    *,
    earlier: Sequence[Round],
) -> Round:
    """One round of stages 1 and 2, on the prompts of the rotation after the ``earlier`` rounds'."""
    candidates = sample_candidates(context, config, policy=sampler, earlier=tuple(step.candidates for step in earlier))
    # The previous reward model judges (labeler reward_model), or its margins choose the pairs asked about.
    judge_model = reward_model if config.labeler == "reward_model" or config.asking.select == "uncertain" else None
    labels = request_human_labels(context, config, candidates, judge_model) if config.labeler == "human" else None
    preferences = collect_preferences(
        context, config, candidates=candidates, reward_model=judge_model, labels=labels,
        earlier=tuple(step.preferences for step in earlier),
    )  # fmt: skip
    return Round(candidates, preferences)


@flow(name="rlhf-campaign", flow_run_name=_campaign_run_name)
def rlhf_campaign(
    config: PipelineConfig, from_iteration: int | None = None, base: BaseInputs | None = None
) -> IterationState:
    """``config.iterations`` iterations, each continuing from the previous one's policy and reward model.

    A finished iteration is kept as it is, whatever code, library versions, input contents or changeable settings
    (PPO or advantage settings, the number of iterations) this run brings: they apply from the first unfinished
    iteration on, and a notice says what differs (:func:`campaign.history.what_differs`). ``from_iteration``
    recomputes the finished iterations from that one on, in new runs that supersede the old ones.

    Raises:
        ConfigError: ``from_iteration`` cannot be recomputed (:func:`campaign.history.check_from_iteration`).
    """
    with pinned_code(STAGE_MODULES), cluster(config.execution):  # one local cluster for every iteration
        base = supervised_base(config, base or resolve_base(config))
        finished = finished_iterations(config)
        start = next((n for n in range(config.iterations) if n not in finished), config.iterations)
        if from_iteration is not None:
            start = from_iteration
        state = finished_state(config, base, finished.get(start - 1))
        check_from_iteration(from_iteration, finished, optimizer_states_present=_continuable(state))
        earlier = {n: run for n, run in finished.items() if n < start}
        # The engine the iterations sample on (the command started it already) says its vLLM version.
        engine_url = generation_engine(config, base.policy.path) if earlier else None
        vllm = None if engine_url is None else engine_identity(engine_url)["vllm"]
        if earlier and (note := what_differs(earlier, base, vllm=vllm)):
            get_run_logger().info("campaign %s: %s", config.campaign, note, extra={STAGE_EVENT: "notice"})
        for iteration in range(start, config.iterations):
            ahead = iteration + 1 < config.iterations
            state = rlhf_iteration(config, iteration, state, fresh=iteration in finished, base=base, ahead=ahead)
    return state


def _continuable(state: IterationState | None) -> bool:
    """Whether a PPO update can continue ``state``'s policy exactly: it has no optimizer states, or they are there."""
    states = None if state is None else optimizer_state(state.policy)
    return states is None or states.present


@flow(name="rlhf-replay", flow_run_name=_replay_run_name)
def rlhf_replay(config: PipelineConfig, source_run_id: str, base: BaseInputs | None = None) -> str:
    """Re-run rewards/KL/GAE, the PPO update and evaluation of a recorded iteration; no generation. A DPO iteration's
    replay re-runs its DPO update and evaluation, on the pairs and the reference's log-probs it stored.

    ``base``: the base inputs the command resolved already, or None to resolve them. Returns the replay's MLflow
    run id (tagged ``rlhf.replay_of`` = ``source_run_id``). It writes into the
    campaign's folder and MLflow experiment, so it holds the campaign's lock like an iteration.
    """
    check_replayable(config, source_run_id)
    layout = campaign_layout(config)
    with (
        pinned_code(STAGE_MODULES),
        exclusive_lock(layout.lock_file()),
        campaign_slot(config.campaign, layout.slot_file()),
        cluster(config.execution),
    ):
        base = supervised_base(config, base or resolve_base(config))
        inputs = load_replay_inputs(config, source_run_id, base)
        if config.update == "ppo":
            check_replay_data(config, inputs.experience)
        context = open_replay(config, source_run_id, base)
        with (
            context.tracker.ends_on_error(context.parent_run_id),
            announces_failure(config.campaign, _failure_payload(context, "replay", inputs.policy)),
            gpu_stages(resolve_device(config.execution.device).type, campaign=config.campaign),
        ):
            return _replay(config, context, inputs)


def _replay(config: PipelineConfig, context: StageContext, inputs: ReplayInputs) -> str:
    _, training = lanes(context, config)  # the threads and process its source's update had
    if config.update == "dpo":  # the pairs and the reference's stored log-probs: no reference forward
        scored, new_policy = None, dpo_update(training, config, policy=inputs.policy, pairs=inputs.experience)
    else:
        values = inputs.critic_values if config.advantages.uses_critic else None  # read back: no critic runs
        scored = compute_advantages(
            training,
            config,
            experience=inputs.experience,
            critic_values=values,
            reward_model=inputs.reward_model,
            previous=inputs.previous,
        )
        optimizer = optimizer_state(inputs.policy, present_only=True)
        critic_start = _critic_start(config, inputs.policy, inputs.reward_model)
        new_policy = ppo_update(
            training, config, policy=inputs.policy, optimizer=optimizer, scored=scored, critic_start=critic_start
        )
    evaluation = _evaluation(config, context, new_policy, inputs.reward_model)
    state = IterationState(new_policy, inputs.reward_model, advantages=scored)
    stages = [*filter(None, [scored]), new_policy, *evaluation]
    close_iteration(context, stages, state, experience=inputs.experience)
    return context.parent_run_id
