"""Rewards and advantages of multi-turn episodes: the model answers, the environment replies, the model answers again.

An episode is one row: ``[prompt | model turn 1 | environment reply | model turn 2 | ... | padding]``. Its
``model_mask: bool (B, R)`` is True at the model's tokens (the actions) and False at the environment's tokens and at
padding. It is not a prefix mask: it has a gap at every environment reply, and may have padding in a gap. A
single-turn row is the episode whose mask is a prefix, and every function here then gives the single-turn
function's result bit for bit (a tested invariant).

Choices:
1. A turn is a maximal run of model tokens: consecutive turns are always separated by the environment's reply
   (at least the chat template's turn markers, e.g. SmolLM2's ``\\n<|im_start|>user ... <|im_start|>assistant\\n``).
   ``turn_rewards: (B, N)`` holds turn ``k``'s reward in column ``k``, zero-padded to the longest episode.
2. Each turn's reward lands on that turn's last model token, as the sequence score lands on the last action
   token (:func:`rlhf_core.rewards.shaped_rewards`); SkyRL's ``_build_per_token_rewards`` does the same
   (``research/multi-turn-2026.md``). The KL penalty is on every model token, from ``shaped_rewards`` itself.
   The episode's reward is the sum of its turn rewards (issue 44's ``reward.source: environment``; OpenRLHF and
   NeMo-RL sum them too).
3. The environment's tokens are not actions: no reward, no value, no advantage, and no time step. Every
   recursion (GAE, reward-to-go) runs over the model's tokens in order, as if the environment's were not there:
   the value after turn ``k``'s last token is the value at turn ``k + 1``'s first token, one discount away. That
   is verl's ``compute_gae_advantage_return`` with a response mask ("skip values and TD-error on observation
   tokens", verl-project/verl ``verl/trainer/ppo/core_algos.py`` at b178a3c), which carries ``nextvalues`` and
   ``lastgaelam`` unchanged through masked tokens. Here the model's tokens are packed to the front
   (:func:`model_token_order`), the single-turn function runs on the packed prefix mask, and the results go back
   to their columns. Unlike verl, advantages and returns are 0 at masked tokens (verl leaves the carried values
   there and relies on the loss mask).
4. Critic-free estimators see the episode reward (GRPO, Dr. GRPO, RLOO against the group, broadcast over the
   model's tokens only, as prime-rl's ``orchestrator/algo/grpo.py`` broadcasts over a trace), or the return of the
   shaped rewards over the model's tokens (REINFORCE++): a turn's return includes every later turn's reward and KL
   penalty, discounted once per model token. verl's ``compute_reinforce_plus_plus_outcome_advantage`` instead
   resets the running return at every masked token ("Reset after EOS"), so on an episode a turn's return would
   stop at the environment's reply and never see a later turn's reward; that is not followed. With gamma = 1 the
   two readings of the gap (skipped, or zero-reward steps) agree; they differ only under a discount.
5. Whatever sits at a masked position (even inf or nan) never reaches a result (a tested invariant), and padding
   anywhere, between turns too, never changes the result at the model's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_core.advantages import broadcast_over_tokens, group_advantages, reinforce_pp_advantages, reward_to_go
from rlhf_core.config import Estimator, KLEstimator
from rlhf_core.gae import Advantages, compute_gae
from rlhf_core.rewards import ShapedRewards, shaped_rewards


def turn_index(model_mask: torch.Tensor) -> torch.Tensor:
    """The turn (0, 1, ...) of each model token, counting runs of True; -1 at every other token.

    Example: ``[1, 1, 0, 0, 1, 0, 1]`` gives ``[0, 0, -1, -1, 1, -1, 2]``.

    Shapes:
        model_mask: (B, R); returns (B, R) long.
    """
    mask = model_mask.bool()
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)  # (B, R): the token before is the model's
    starts = mask & ~before  # (B, R)
    return torch.where(mask, starts.long().cumsum(dim=1) - 1, -1)  # (B, R)


def turn_ends(model_mask: torch.Tensor) -> torch.Tensor:
    """True at each turn's last model token.

    Shapes:
        model_mask: (B, R); returns (B, R) bool.
    """
    mask = model_mask.bool()
    after = torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)  # (B, R): the token after is the model's
    return mask & ~after


def place_turn_rewards(turn_rewards: torch.Tensor, model_mask: torch.Tensor) -> torch.Tensor:
    """Each turn's reward at that turn's last model token, 0 everywhere else.

    Naive equivalent::

        for b in range(B):
            for k, t in enumerate(t for t in range(R) if turn_ends(model_mask)[b, t]):
                scores[b, t] = turn_rewards[b, k]

    A row with no model token gets no reward (as :func:`rlhf_core.rewards.shaped_rewards` gives a row
    without actions none): an episode masked out of the loss keeps its turn rewards for its group's
    baseline.

    Shapes:
        turn_rewards: (B, N), zero-padded; model_mask: (B, R); returns (B, R) in ``turn_rewards``' dtype.

    Raises:
        ValueError: a row with more turns than ``N``, or a nonzero reward for a turn a row with model
            tokens does not have (the rewards and the mask disagree on the turns).
    """
    if turn_rewards.dim() != 2 or turn_rewards.shape[0] != model_mask.shape[0]:
        raise ValueError(f"`turn_rewards` must have shape ({model_mask.shape[0]}, N), got {tuple(turn_rewards.shape)}")
    index = turn_index(model_mask)  # (B, R)
    turns = index.amax(dim=1) + 1  # (B,): -1 + 1 = 0 for a row with no model token
    columns = turn_rewards.shape[1]
    if bool((turns > columns).any()):
        row = int((turns > columns).nonzero()[0, 0])
        raise ValueError(f"row {row} has {int(turns[row])} model turns but `turn_rewards` has {columns} columns")
    missing = (torch.arange(columns, device=turns.device) >= turns[:, None]) & (turns[:, None] > 0)  # (B, N)
    if bool((missing & (turn_rewards != 0)).any()):
        row, turn = (int(i) for i in (missing & (turn_rewards != 0)).nonzero()[0])
        raise ValueError(f"row {row} has a reward for turn {turn} but only {int(turns[row])} model turns")
    if columns == 0:
        return torch.zeros(model_mask.shape, dtype=turn_rewards.dtype, device=turn_rewards.device)
    placed = turn_rewards.gather(1, index.clamp(min=0))  # (B, R)
    return torch.where(turn_ends(model_mask), placed, torch.zeros_like(placed))


@torch.no_grad()
def episode_shaped_rewards(
    turn_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    model_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> ShapedRewards:
    """Per-token rewards ``r_t = -kl_coef * kl_t + [t ends turn k] * turn_rewards[k]`` at the model's tokens.

    The KL term is :func:`rlhf_core.rewards.shaped_rewards` with a score of 0; the turn rewards are
    :func:`place_turn_rewards`. Clip or normalise ``turn_rewards`` before, as ``score_experience`` does
    the scores. One turn (``N = 1``, a prefix mask) gives ``shaped_rewards(turn_rewards[:, 0], ...)``
    bit for bit.

    Shapes:
        turn_rewards: (B, N); logprobs, ref_logprobs, model_mask: (B, R); returns two (B, R).
    """
    no_score = torch.zeros(model_mask.shape[0], dtype=logprobs.dtype, device=logprobs.device)  # (B,)
    penalty, kl = shaped_rewards(no_score, logprobs, ref_logprobs, model_mask, kl_coef=kl_coef, estimator=estimator)
    rewards = penalty + place_turn_rewards(turn_rewards.to(penalty.dtype), model_mask)  # (B, R)
    return ShapedRewards(rewards=rewards, kl=kl)


def model_token_order(model_mask: torch.Tensor) -> torch.Tensor:
    """A permutation of each row's columns: its model tokens first, in order, then every other column, in order.

    ``x.gather(1, order)`` packs a row's model tokens into a prefix (the mask becomes a prefix mask);
    ``zeros.scatter(1, order, packed)`` puts them back. On a prefix mask it is the identity.

    Shapes:
        model_mask: (B, R); returns (B, R) long.
    """
    others = (~model_mask.bool()).to(torch.int8)  # (B, R): 0 at the model's tokens, which sort first
    return torch.sort(others, dim=1, stable=True).indices  # (B, R)


def _over_model_tokens(
    estimate: Callable[..., torch.Tensor], model_mask: torch.Tensor, *tensors: torch.Tensor, **kwargs: float
) -> tuple[torch.Tensor, ...]:
    """Run a prefix-mask estimator on the model's tokens packed to the front; each (B, R) output back in place."""
    order = model_token_order(model_mask)  # (B, R)
    mask = model_mask.bool()
    packed = [tensor.gather(1, order) for tensor in tensors]  # each (B, R)
    outputs = estimate(*packed, mask.gather(1, order), **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    unpacked = (torch.zeros_like(output).scatter(1, order, output) for output in outputs)  # each (B, R)
    return tuple(torch.where(mask, output, torch.zeros_like(output)) for output in unpacked)


@torch.no_grad()
def episode_gae(
    rewards: torch.Tensor, values: torch.Tensor, model_mask: torch.Tensor, *, gamma: float, gae_lambda: float
) -> Advantages:
    """GAE over the model's tokens, bootstrapping across the environment's (choice 3).

    :func:`rlhf_core.gae.compute_gae` on the model's tokens packed into a prefix. Naive equivalent (one
    row; ``steps`` lists its model-token columns in order)::

        last = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = values[steps[i + 1]] if i + 1 < len(steps) else 0.0
            delta = rewards[t] + gamma * next_value - values[t]
            last = delta + gamma * gae_lambda * last
            advantages[t], returns[t] = last, last + values[t]

    Rewards and values at the environment's tokens and padding are never read.

    Args:
        rewards: per-token rewards (:func:`episode_shaped_rewards`).
        values: the critic's values of the state before each token (read at the model's tokens only).
        model_mask: True at the model's tokens.
        gamma, gae_lambda: discount and GAE lambda, applied once per model token.

    Shapes:
        rewards, values, model_mask: (B, R); returns two (B, R), 0 outside ``model_mask``.

    References:
        Schulman et al. 2016, eq. 16; verl ``compute_gae_advantage_return`` (b178a3c) for the mask.
    """
    advantages, returns = _over_model_tokens(
        compute_gae, model_mask, rewards, values, gamma=gamma, gae_lambda=gae_lambda
    )
    return Advantages(advantages=advantages, returns=returns)


@torch.no_grad()
def episode_reward_to_go(token_rewards: torch.Tensor, model_mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = sum over later model tokens k of gamma^(model tokens from t to k) * r_k``: the environment's tokens
    are skipped, neither a reward nor a discount step (choice 4).

    :func:`rlhf_core.advantages.reward_to_go` on the packed model tokens. With gamma = 1 it equals
    ``reward_to_go(token_rewards, model_mask)`` bit for bit (a zero-reward, undiscounted step adds nothing).

    Shapes:
        token_rewards, model_mask: (B, R); returns (B, R), 0 outside ``model_mask``.
    """
    (returns,) = _over_model_tokens(reward_to_go, model_mask, token_rewards, gamma=gamma)
    return returns


@torch.no_grad()
def episode_reinforce_pp_advantages(
    token_rewards: torch.Tensor, model_mask: torch.Tensor, *, gamma: float = 1.0
) -> Advantages:
    """REINFORCE++ on episodes: the return over the model's tokens (:func:`episode_reward_to_go`), whitened over
    every model token of the batch (:func:`rlhf_core.advantages.reinforce_pp_advantages` on the packed tokens).

    Shapes:
        token_rewards, model_mask: (B, R); returns two (B, R), 0 outside ``model_mask``.
    """
    advantages, returns = _over_model_tokens(reinforce_pp_advantages, model_mask, token_rewards, gamma=gamma)
    return Advantages(advantages=advantages, returns=returns)


@torch.no_grad()
def episode_group_advantages(
    turn_rewards: torch.Tensor,
    rewards: torch.Tensor,
    kl: torch.Tensor,
    model_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: Estimator,
    kl_coef: float,
) -> Advantages:
    """GRPO, Dr. GRPO or RLOO on episodes: the episode reward (the sum of its turn rewards) against its group,
    at every model token, plus the KL penalty still to come over the model's tokens.

    ``advantages = broadcast(group_advantages(turn_rewards.sum(1))) + episode_reward_to_go(-kl_coef * kl)``;
    ``returns = episode_reward_to_go(rewards)``: ``score_experience``'s group branch with the episode
    reward as the score. One turn gives that branch bit for bit.

    Args:
        turn_rewards: each turn's reward, zero-padded (clipped or normalised as wanted).
        rewards, kl: :func:`episode_shaped_rewards` of the same turn rewards.
        model_mask: True at the model's tokens.
        group_ids: the prompt of each episode.
        estimator: ``grpo``, ``dr_grpo`` or ``rloo``.
        kl_coef: the KL coefficient ``rewards`` was shaped with (0 with the KL in the loss).

    Shapes:
        turn_rewards: (B, N); rewards, kl, model_mask: (B, R); group_ids: (B,); returns two (B, R).
    """
    outcome = group_advantages(turn_rewards.sum(dim=1), group_ids, estimator)  # (B,)
    penalty_to_go = episode_reward_to_go(-kl_coef * kl, model_mask)  # (B, R)
    advantages = broadcast_over_tokens(outcome, model_mask) + penalty_to_go  # (B, R)
    return Advantages(advantages=advantages, returns=episode_reward_to_go(rewards, model_mask))
