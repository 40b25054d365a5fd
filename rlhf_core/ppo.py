"""The PPO update of actor and critic (or of the actor alone) over one batch of scored experience.

Choices:
1. Actor and critic are separate models with separate optimizers, so the value loss needs no
   weight against the policy loss (with Adam a constant factor would not change the step).
   Critic-free estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) update the actor alone.
2. Dropout is off during the update, as in TRL's PPO: the probability ratio at the first
   minibatch is then exactly the rollout's, 1. The models stay in train mode with every dropout
   probability at 0 (:func:`rlhf_core.models.dropout_disabled`), so gradient checkpointing,
   which runs in train mode only, still applies.
3. With a critic (GAE), advantages are whitened once over the whole experience
   (``config.whiten_advantages``), then minibatched. Without one they are used as stage 5 made
   them: each critic-free estimator normalises its own (:mod:`rlhf_core.advantages`, choice 4),
   and whitening again would scale Dr. GRPO's and RLOO's advantages, which those methods avoid.
4. Early stop: when ``target_kl`` is set, the update stops at the first minibatch whose
   approximate KL(old || new), measured before its step, exceeds it; that minibatch takes no
   step (OpenAI Spinning Up's rule, without its 1.5 factor).
5. Driven through ``accelerate.Accelerator``: pass models and optimizers already ``prepare``d,
   and the same code runs on one CPU or many GPUs under ``accelerate launch``. With N processes each
   computes on its share of every minibatch, with losses normalised by the whole minibatch's counts and
   statistics all-reduced, so the update equals one process's up to float rounding and the ``target_kl``
   early stop is decided once for all (:mod:`rlhf_core.distributed`).
6. KL in the loss (``config.kl_loss_coef`` > 0, GRPO style): the k3 KL to the reference, from the
   rollout's reference log-probs, is added to the policy loss (:func:`rlhf_core.losses.reference_kl_loss`);
   its value is reported as ``ref_kl`` either way.
7. Rows an older policy sampled (``sampling.staleness``): given ``prox_logprobs`` (the policy the update starts from)
   and ``config.off_policy`` ``decoupled``, the ratio is taken to them and every token weighed by its capped behaviour
   weight (decoupled PPO, :mod:`rlhf_core.off_policy`); without them the ratio is to ``old_logprobs``.
8. A KL budget (``config.kl_budget``, nats per response): the update stops at the first minibatch whose estimate of
   the current policy's KL to the reference (:func:`kl_to_reference`), measured before its step, exceeds it; that
   minibatch takes no step. A policy already past it when the update starts takes none: it stays as it was, and the
   update's statistics are its first minibatch's, measured (``optimizer_steps`` 0, ``at_kl_budget``). The policy may
   pass the budget by what one step moves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel

from rlhf_core.config import PPOConfig
from rlhf_core.distributed import global_sum, rank_share
from rlhf_core.divergence import MAX_SKIPPED_STEPS, check_weights, guarded_step
from rlhf_core.experience import Experience
from rlhf_core.losses import entropy_from_logits, loss_denominator, policy_loss, reference_kl_loss, value_loss
from rlhf_core.masked import masked_sum, masked_var, masked_whiten
from rlhf_core.mismatch import tis_weights
from rlhf_core.models import Critic, dropout_disabled, fused_activations
from rlhf_core.off_policy import decoupled_weights
from rlhf_core.rewards import kl_estimate
from rlhf_core.sequences import response_logits, response_slice, token_logprobs


class MinibatchStats(NamedTuple):
    """Detached statistics of one minibatch (scalar tensors); :class:`PPOStats` averages them.

    The value statistics are None in an update without a critic.
    """

    policy_loss: torch.Tensor
    value_loss: torch.Tensor | None
    clip_fraction: torch.Tensor
    value_clip_fraction: torch.Tensor | None
    approx_kl: torch.Tensor
    entropy: torch.Tensor
    ref_kl: torch.Tensor
    kl_to_reference: torch.Tensor | None = None
    """With a KL budget: the current policy's KL to the reference per response (:func:`kl_to_reference`), the
    minibatch's mean."""


class PPOStats(NamedTuple):
    """Means over the optimizer steps taken (scalar tensors), plus counts; value statistics None without a critic.

    ``policy_loss`` includes the KL term when ``kl_loss_coef`` > 0; ``ref_kl`` is the mean k3 KL
    of the current policy to the reference over valid tokens.
    """

    policy_loss: torch.Tensor
    value_loss: torch.Tensor | None
    clip_fraction: torch.Tensor
    value_clip_fraction: torch.Tensor | None
    approx_kl: torch.Tensor
    entropy: torch.Tensor
    ref_kl: torch.Tensor
    kl_to_reference: torch.Tensor | None
    explained_variance: torch.Tensor | None
    optimizer_steps: int
    early_stopped: bool
    skipped_steps: int = 0
    """Steps the fp16 loss scaler skipped (its scaled loss overflowed; the models' optimizers each count)."""
    at_kl_budget: bool | None = None
    """With a KL budget: whether the update stopped at it (choice 8); None without one."""


class PPOProgress(NamedTuple):
    """Where an update stands after a whole epoch: enough to continue it exactly after a crash.

    ``totals`` are the running sums of the :class:`MinibatchStats` fields that the update has
    (the value ones only with a critic), by name, as floats.
    """

    epochs_done: int
    totals: dict[str, float]
    optimizer_steps: int


class _Losses(NamedTuple):
    actor_loss: torch.Tensor
    critic_loss: torch.Tensor | None
    stats: MinibatchStats


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over valid tokens; 1 is a perfect critic.

    Shapes:
        values, returns, mask: (B, R); returns ().
    """
    return 1.0 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)


@torch.no_grad()
def kl_to_reference(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """Each response's KL(policy || reference) in nats, estimated on tokens an older policy sampled: the sum over its
    tokens of ``exp(logprobs - old_logprobs) * (logprobs - ref_logprobs)``, the k1 estimate each token weighed by its
    probability ratio (per token, as PPO's surrogate objective weighs advantages: the states' shift is left out, a
    first-order estimate near the sampling policy). Where the policy is the sampling one, it is the rollout's k1 KL
    summed over the response, as evaluation measures it (``evaluate/kl_to_reference``).

    Shapes:
        logprobs, old_logprobs, ref_logprobs, action_mask: (B, R); returns (B,).

    References:
        Schulman et al. 2015 (TRPO), section 3 (the surrogate's per-state ratio); Schulman, "Approximating KL
        divergence", 2020 (k1).
    """
    valid = action_mask.bool()
    ratio = torch.exp(torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs)))  # (B, R)
    k1 = torch.where(valid, kl_estimate(logprobs, ref_logprobs, estimator="k1"), torch.zeros_like(logprobs))  # (B, R)
    return (ratio * k1).sum(dim=1)  # (B,)


class Denominators(NamedTuple):
    """Counts of a whole minibatch that the losses of a share of it are divided by (:mod:`rlhf_core.distributed`).

    ``tokens``: its valid tokens (the entropy bonus is a token mean); ``loss``: what its aggregation
    divides by (:func:`rlhf_core.losses.loss_denominator`); ``rows``: its rows (the KL budget's estimate is a mean
    over responses).
    """

    tokens: torch.Tensor
    loss: torch.Tensor
    rows: int = 1


def _minibatch_losses(
    actor: PreTrainedModel,
    critic: Critic | None,
    batch: Experience,
    config: PPOConfig,
    *,
    temperature: float,
    norm_tokens: int | None,
    denominators: Denominators,
) -> _Losses:
    """Policy loss (with its KL term), value loss (with a critic) and detached stats for ``batch``, a share of
    a minibatch: the losses (and the ``policy_loss``, ``value_loss`` and ``entropy`` stats) are divided by the
    whole minibatch's ``denominators``; the other stats are token means over ``batch``."""
    prompt_length = batch.prompt_length
    aggregation = {"aggregation": config.aggregation, "norm_tokens": norm_tokens, "denominator": denominators.loss}
    logits = response_logits(actor, batch.sequences, batch.attention_mask, prompt_length)  # (b, R, V)
    logprobs, entropy = token_logprobs(logits, batch.sequences[:, prompt_length:], temperature=temperature)  # (b, R)
    weights = None
    if config.tis_cap is not None:
        if batch.engine_logprobs is None:
            raise ValueError("`tis_cap` needs the sampler's log-probs (`engine_logprobs`); this rollout kept none")
        weights = tis_weights(batch.old_logprobs, batch.engine_logprobs, batch.action_mask, cap=config.tis_cap)
    pi_old = batch.old_logprobs
    if config.off_policy == "decoupled" and batch.prox_logprobs is not None:  # choice 7
        behaviour = decoupled_weights(
            batch.prox_logprobs, batch.old_logprobs, batch.action_mask, cap=config.behaviour_weight_cap
        )  # (b, R)
        weights = behaviour if weights is None else weights * behaviour
        pi_old = batch.prox_logprobs
    actor_loss, policy_stats = policy_loss(
        logprobs,
        pi_old,
        batch.advantages,
        batch.action_mask,
        clip_eps=config.clip_eps,
        dual_clip=config.dual_clip,
        weights=weights,
        **aggregation,
    )
    # Without the KL term it is only a statistic: no graph through it.
    with torch.set_grad_enabled(bool(config.kl_loss_coef) and torch.is_grad_enabled()):
        kl_loss, kl_stats = reference_kl_loss(logprobs, batch.ref_logprobs, batch.action_mask, **aggregation)
    if config.kl_loss_coef:
        actor_loss = actor_loss + config.kl_loss_coef * kl_loss
    budget_kl = None  # choice 8: a share of the whole minibatch's mean over responses
    if config.kl_budget is not None:
        per_response = kl_to_reference(logprobs, batch.old_logprobs, batch.ref_logprobs, batch.action_mask)  # (b,)
        budget_kl = per_response.sum() / denominators.rows
    # Without an entropy bonus the entropy is only a statistic, computed in the fused pass above; with one it
    # needs an autograd graph over (b, R, V). A token mean over the whole minibatch's tokens (a share of it).
    if config.entropy_coef:
        entropy = entropy_from_logits(logits.float() / temperature)  # (b, R)
    entropy = masked_sum(entropy, batch.action_mask) / denominators.tokens
    if config.entropy_coef:
        actor_loss = actor_loss - config.entropy_coef * entropy
    critic_loss = value_clip_fraction = None
    if critic is not None:
        values = response_slice(critic(batch.sequences, batch.attention_mask), prompt_length)  # (b, R)
        critic_loss, value_stats = value_loss(
            values,
            batch.old_values,
            batch.returns,
            batch.action_mask,
            value_clip_eps=config.value_clip_eps,
            **aggregation,
        )
        value_clip_fraction = value_stats.clip_fraction
    stats = MinibatchStats(
        policy_loss=actor_loss.detach(),
        value_loss=None if critic_loss is None else critic_loss.detach(),
        clip_fraction=policy_stats.clip_fraction,
        value_clip_fraction=value_clip_fraction,
        approx_kl=policy_stats.approx_kl,
        entropy=entropy.detach(),
        ref_kl=kl_stats.kl,
        kl_to_reference=budget_kl,
    )
    return _Losses(actor_loss, critic_loss, stats)


_SHARE_STATS = ("policy_loss", "value_loss", "entropy", "kl_to_reference")
"""Statistics already divided by the whole minibatch's counts: the processes' values add up."""


def _minibatch_stats(
    stats: MinibatchStats, batch: Experience, weight: float, denominators: Denominators, accelerator: Accelerator
) -> MinibatchStats:
    """The whole minibatch's statistics from every process's share (one all-reduce); ``stats`` with one process.

    A share's loss statistics add up over processes; its other statistics are token means over the
    share, so they are weighted by the share's valid tokens (0 for a stand-in row).
    """
    if accelerator.num_processes == 1:
        return stats
    names = [name for name, value in stats._asdict().items() if value is not None]
    tokens = batch.action_mask.sum().to(torch.float32)
    local = torch.stack(
        [
            getattr(stats, name).float() * weight * (1.0 if name in _SHARE_STATS else tokens / denominators.tokens)
            for name in names
        ]
    )  # (S,)
    reduced = global_sum(accelerator, local)  # (S,)
    return stats._replace(**{name: reduced[index] for index, name in enumerate(names)})


def ppo_update(
    actor: PreTrainedModel,
    critic: Critic | None,
    actor_optimizer: torch.optim.Optimizer,
    critic_optimizer: torch.optim.Optimizer | None,
    experience: Experience,
    config: PPOConfig,
    *,
    accelerator: Accelerator,
    temperature: float,
    norm_tokens: int | None = None,
    generator: torch.Generator | None = None,
    resume: PPOProgress | None = None,
    on_epoch_end: Callable[[PPOProgress], None] | None = None,
    on_step: Callable[[int, MinibatchStats], None] | None = None,
    max_skipped_steps: int = MAX_SKIPPED_STEPS,
) -> PPOStats:
    """``config.epochs`` passes of minibatch PPO over ``experience``.

    Args:
        actor, critic: trainable models, ``accelerator.prepare``d; ``critic`` None for a
            critic-free estimator (the actor alone is updated).
        actor_optimizer, critic_optimizer: their optimizers, ``prepare``d too (None with no critic).
        experience: scored experience (advantages and returns filled in; values with a critic), with the
            ``prox_logprobs`` of the policy the update starts from where rows are stale (choice 7).
        config: epochs, minibatch size, clip ranges, entropy and KL weights, gradient clip,
            target KL, loss aggregation.
        accelerator: drives backward passes, gradient clipping and mixed precision.
        temperature: the sampling temperature the rollout used (log-probs must match it).
        norm_tokens: the constant of the ``token_sum_norm`` aggregation (the generation budget).
        generator: CPU random stream for minibatch shuffling.
        resume: continue after ``resume.epochs_done`` epochs; the caller restores the models,
            optimizers and ``generator`` state saved at that point.
        on_epoch_end: called after every whole epoch (not after an early stop), e.g. to save a
            checkpoint with the models, optimizers and ``generator`` state.
        on_step: called after every optimizer step with the step number (from 1) and the minibatch's
            statistics, e.g. to record training curves.
        max_skipped_steps: under fp16's loss scaler, the steps it may skip in a row before the update counts as
            diverged (:data:`rlhf_core.divergence.MAX_SKIPPED_STEPS`).

    Returns:
        :class:`PPOStats` averaged over the optimizer steps taken.
    """
    if not experience.is_scored:
        raise ValueError("`experience` has no advantages/returns: run score_experience first")
    if (critic is None) != (critic_optimizer is None):
        raise ValueError("pass `critic` and `critic_optimizer` together, or neither (a critic-free update)")
    if critic is not None and experience.old_values is None:
        raise ValueError("the experience has no critic values (a rollout without a critic): it cannot train one")
    trained = experience.action_mask.any(dim=1)  # (B,)
    if not bool(trained.all()):
        # A row with no action (an episode kept out of the loss: rlhf_core.episodes) trains nothing, and a minibatch
        # of such rows alone would have no token to average over: the update leaves them out.
        if not bool(trained.any()):
            raise ValueError("no row of `experience` has an action token: there is nothing to train on")
        experience = experience.select(trained.nonzero().squeeze(1))
    experience = experience.to(accelerator.device)
    variance_explained = None
    if critic is not None:
        if config.whiten_advantages:
            experience = experience.replace(advantages=masked_whiten(experience.advantages, experience.action_mask))
        variance_explained = explained_variance(experience.old_values, experience.returns, experience.action_mask)

    totals = {name: torch.tensor(total) for name, total in resume.totals.items()} if resume else None
    steps = resume.optimizer_steps if resume else 0
    early_stopped = False
    at_kl_budget = False if config.kl_budget is not None else None
    scaled = accelerator.scaler is not None  # fp16: an overflowing step is skipped, not a divergence
    in_a_row, skipped = {"actor": 0, "critic": 0}, 0
    world, rank = accelerator.num_processes, accelerator.process_index
    with dropout_disabled(actor, critic), fused_activations(actor, critic):
        for epoch in range(resume.epochs_done if resume else 0, config.epochs):
            for minibatch in experience.minibatches(config.minibatch_size, generator=generator):
                # 1. this process's share of the minibatch, normalised by the whole minibatch's counts
                rows, weight = rank_share(minibatch.batch_size, rank=rank, world=world)
                batch = minibatch.select(rows)
                denominators = Denominators(
                    tokens=minibatch.action_mask.sum().to(torch.float32),
                    loss=loss_denominator(minibatch.action_mask, mode=config.aggregation, norm_tokens=norm_tokens),
                    rows=minibatch.batch_size,
                )
                losses = _minibatch_losses(
                    actor, critic, batch, config, temperature=temperature, norm_tokens=norm_tokens,
                    denominators=denominators,
                )  # fmt: skip
                stats = _minibatch_stats(losses.stats, batch, weight, denominators, accelerator)
                # 2. stop before stepping past the KL target (every process decides on the same, reduced, value)
                if config.target_kl is not None and stats.approx_kl.item() > config.target_kl:
                    early_stopped = True
                    break
                if config.kl_budget is not None and stats.kl_to_reference.item() > config.kl_budget:  # choice 8
                    early_stopped = at_kl_budget = True
                    break
                # 3. one step for each model, each with its own gradient clip; DDP averages the gradients of the
                #    processes' shares, so each backpropagates N times its share (0 times for a stand-in row)
                #    (a non-finite loss or gradient norm stops the update before its step: it diverged; under fp16's
                #    loss scaler a non-finite norm is a step the scaler skips, and only max_skipped_steps in a row are)
                steps_to_take = [("actor", losses.actor_loss, actor, actor_optimizer, config.actor_learning_rate)]
                if critic is not None:
                    steps_to_take.append(
                        ("critic", losses.critic_loss, critic, critic_optimizer, config.critic_learning_rate)
                    )
                for name, loss, model, optimizer, learning_rate in steps_to_take:
                    in_a_row[name] = guarded_step(
                        accelerator, optimizer, model, loss, scale=world * weight, max_grad_norm=config.max_grad_norm,
                        scaled=scaled, in_a_row=in_a_row[name], limit=max_skipped_steps,
                        diverged={"model": name, "step": steps + 1, "learning_rate": learning_rate},
                    )  # fmt: skip
                    skipped += in_a_row[name] > 0
                # 4. bookkeeping (the value statistics only with a critic)
                step_stats = {name: value for name, value in stats._asdict().items() if value is not None}
                totals = step_stats if totals is None else {name: totals[name] + step_stats[name] for name in totals}
                steps += 1
                if on_step is not None:
                    on_step(steps, stats)
            if early_stopped:
                break
            if on_epoch_end is not None:
                on_epoch_end(PPOProgress(epoch + 1, {name: float(total) for name, total in totals.items()}, steps))
    if (steps == 0 or totals is None) and at_kl_budget:  # choice 8: past the budget already; the models stay
        measured = {name: value for name, value in stats._asdict().items() if value is not None}
        return PPOStats(
            **{name: measured.get(name) for name in MinibatchStats._fields},
            explained_variance=variance_explained,
            optimizer_steps=0,
            early_stopped=True,
            at_kl_budget=True,
        )
    if steps == 0 or totals is None:
        raise ValueError("the update took no optimizer step (`target_kl` exceeded before the first step)")
    check_weights(actor, model="actor", learning_rate=config.actor_learning_rate)
    if critic is not None:
        check_weights(critic, model="critic", learning_rate=config.critic_learning_rate)
    means = {name: totals[name] / steps if name in totals else None for name in MinibatchStats._fields}
    return PPOStats(
        **means,
        explained_variance=variance_explained,
        optimizer_steps=steps,
        early_stopped=early_stopped,
        skipped_steps=skipped,
        at_kl_budget=at_kl_budget,
    )
