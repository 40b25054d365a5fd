"""The PPO update of actor and critic over one batch of scored experience.

Choices:
1. Actor and critic are separate models with separate optimizers, so the value loss needs no
   weight against the policy loss (with Adam a constant factor would not change the step).
2. Dropout is off during the update, as in TRL's PPO: the probability ratio at the first
   minibatch is then exactly the rollout's, 1. The models stay in train mode with every dropout
   probability at 0 (:func:`rlhf_core.models.dropout_disabled`), so gradient checkpointing,
   which runs in train mode only, still applies.
3. Advantages are whitened once over the whole experience, then minibatched.
4. Early stop: when ``target_kl`` is set, the update stops at the first minibatch whose
   approximate KL(old || new), measured before its step, exceeds it; that minibatch takes no
   step (OpenAI Spinning Up's rule, without its 1.5 factor).
5. Driven through ``accelerate.Accelerator``: pass models and optimizers already ``prepare``d,
   and the same code runs on one CPU or many GPUs under ``accelerate launch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel

from rlhf_core.config import PPOConfig
from rlhf_core.experience import Experience
from rlhf_core.losses import entropy_from_logits, policy_loss, value_loss
from rlhf_core.masked import masked_mean, masked_var, masked_whiten
from rlhf_core.models import Critic, dropout_disabled, fused_activations
from rlhf_core.sequences import logprobs_from_logits, response_logits, response_slice


class MinibatchStats(NamedTuple):
    """Detached statistics of one minibatch (scalar tensors); :class:`PPOStats` averages them."""

    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    clip_fraction: torch.Tensor
    value_clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    entropy: torch.Tensor


class PPOStats(NamedTuple):
    """Means over the optimizer steps taken (scalar tensors), plus counts."""

    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    clip_fraction: torch.Tensor
    value_clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    entropy: torch.Tensor
    explained_variance: torch.Tensor
    optimizer_steps: int
    early_stopped: bool


class PPOProgress(NamedTuple):
    """Where an update stands after a whole epoch: enough to continue it exactly after a crash.

    ``totals`` are the running sums of the :class:`MinibatchStats` fields, by name, as floats.
    """

    epochs_done: int
    totals: dict[str, float]
    optimizer_steps: int


class _Losses(NamedTuple):
    actor_loss: torch.Tensor
    critic_loss: torch.Tensor
    stats: MinibatchStats


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over valid tokens; 1 is a perfect critic.

    Shapes:
        values, returns, mask: (B, R); returns ().
    """
    return 1.0 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)


def _minibatch_losses(
    actor: PreTrainedModel, critic: Critic, batch: Experience, config: PPOConfig, *, temperature: float
) -> _Losses:
    """Policy loss, value loss and detached stats for one minibatch."""
    prompt_length = batch.prompt_length
    logits = response_logits(actor, batch.sequences, batch.attention_mask, prompt_length)  # (b, R, V)
    scaled = logits.float() / temperature  # (b, R, V)
    logprobs = logprobs_from_logits(scaled, batch.sequences[:, prompt_length:])  # (b, R)
    actor_loss, policy_stats = policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.action_mask,
        clip_eps=config.clip_eps,
        dual_clip=config.dual_clip,
        aggregation=config.aggregation,
    )
    # Without an entropy bonus the entropy is only a statistic: no autograd graph over (b, R, V).
    with torch.set_grad_enabled(bool(config.entropy_coef) and torch.is_grad_enabled()):
        entropy = masked_mean(entropy_from_logits(scaled), batch.action_mask)
    if config.entropy_coef:
        actor_loss = actor_loss - config.entropy_coef * entropy
    values = response_slice(critic(batch.sequences, batch.attention_mask), prompt_length)  # (b, R)
    critic_loss, value_stats = value_loss(
        values,
        batch.old_values,
        batch.returns,
        batch.action_mask,
        value_clip_eps=config.value_clip_eps,
        aggregation=config.aggregation,
    )
    stats = MinibatchStats(
        policy_loss=actor_loss.detach(),
        value_loss=critic_loss.detach(),
        clip_fraction=policy_stats.clip_fraction,
        value_clip_fraction=value_stats.clip_fraction,
        approx_kl=policy_stats.approx_kl,
        entropy=entropy.detach(),
    )
    return _Losses(actor_loss, critic_loss, stats)


def ppo_update(
    actor: PreTrainedModel,
    critic: Critic,
    actor_optimizer: torch.optim.Optimizer,
    critic_optimizer: torch.optim.Optimizer,
    experience: Experience,
    config: PPOConfig,
    *,
    accelerator: Accelerator,
    temperature: float,
    generator: torch.Generator | None = None,
    resume: PPOProgress | None = None,
    on_epoch_end: Callable[[PPOProgress], None] | None = None,
) -> PPOStats:
    """``config.epochs`` passes of minibatch PPO over ``experience``.

    Args:
        actor, critic: trainable models, ``accelerator.prepare``d.
        actor_optimizer, critic_optimizer: their optimizers, ``prepare``d too.
        experience: scored experience (advantages and returns filled in).
        config: epochs, minibatch size, clip ranges, entropy weight, gradient clip, target KL.
        accelerator: drives backward passes, gradient clipping and mixed precision.
        temperature: the sampling temperature the rollout used (log-probs must match it).
        generator: CPU random stream for minibatch shuffling.
        resume: continue after ``resume.epochs_done`` epochs; the caller restores the models,
            optimizers and ``generator`` state saved at that point.
        on_epoch_end: called after every whole epoch (not after an early stop), e.g. to save a
            checkpoint with the models, optimizers and ``generator`` state.

    Returns:
        :class:`PPOStats` averaged over the optimizer steps taken.
    """
    if not experience.is_scored:
        raise ValueError("`experience` has no advantages/returns: run score_experience first")
    experience = experience.to(accelerator.device)
    advantages = experience.advantages
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, experience.action_mask)
    experience = experience.replace(advantages=advantages)
    variance_explained = explained_variance(experience.old_values, experience.returns, experience.action_mask)

    totals = {name: torch.tensor(resume.totals[name]) for name in MinibatchStats._fields} if resume else None
    steps = resume.optimizer_steps if resume else 0
    early_stopped = False
    with dropout_disabled(actor, critic), fused_activations(actor, critic):
        for epoch in range(resume.epochs_done if resume else 0, config.epochs):
            for batch in experience.minibatches(config.minibatch_size, generator=generator):
                # 1. losses on the current policy and critic; stop before stepping past the KL target
                losses = _minibatch_losses(actor, critic, batch, config, temperature=temperature)
                if config.target_kl is not None and losses.stats.approx_kl.item() > config.target_kl:
                    early_stopped = True
                    break
                # 2. one step for each model, each with its own gradient clip
                for loss, model, optimizer in (
                    (losses.actor_loss, actor, actor_optimizer),
                    (losses.critic_loss, critic, critic_optimizer),
                ):
                    optimizer.zero_grad(set_to_none=True)
                    accelerator.backward(loss)
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                    optimizer.step()
                # 3. bookkeeping
                step_stats = losses.stats._asdict()
                totals = step_stats if totals is None else {name: totals[name] + step_stats[name] for name in totals}
                steps += 1
            if early_stopped:
                break
            if on_epoch_end is not None:
                on_epoch_end(PPOProgress(epoch + 1, {name: float(total) for name, total in totals.items()}, steps))
    if steps == 0 or totals is None:
        raise ValueError("the update took no optimizer step (`target_kl` exceeded before the first step)")
    means = {name: total / steps for name, total in totals.items()}
    return PPOStats(**means, explained_variance=variance_explained, optimizer_steps=steps, early_stopped=early_stopped)
