"""ExperienceMaker and score_experience: every field equals its definition, and scoring equals the maths."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import AdvantageConfig, SamplingConfig
from rlhf_core.episodes import episode_gae, episode_shaped_rewards
from rlhf_core.experience import Experience
from rlhf_core.experience_maker import ExperienceMaker, compute_values, episode_experience, score_experience
from rlhf_core.gae import compute_gae
from rlhf_core.models import Critic, RewardModel, freeze
from rlhf_core.rewards import last_action_index, shaped_rewards
from rlhf_core.sequences import position_ids_from_mask, response_logprobs, response_slice, sequence_logprobs
from tests.conftest import EOS, PAD, left_padded, tiny_causal_lm, tiny_config

CLOSE = dict(rtol=0.0, atol=1e-5)
TEMPERATURE = 0.8
PROMPTS = [[3, 4, 5, 6], [7], [8, 9], [10, 11, 12]]


def count_score(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Programmatic score: how many real tokens equal 7, plus 0.1 per real token. Shapes: returns (B,)."""
    real = attention_mask.bool()
    return ((sequences == 7) & real).float().sum(dim=1) + 0.1 * real.float().sum(dim=1)


@pytest.fixture(scope="module")
def parts():
    actor = tiny_causal_lm("gpt2", seed=0)
    reference = freeze(tiny_causal_lm("gpt2", seed=5))
    torch.manual_seed(1)
    critic = Critic(config=tiny_config("gpt2"))
    return actor, reference, critic


def make(parts, *, reward=count_score, seed=24, **kwargs) -> Experience:
    actor, reference, critic = parts
    maker = ExperienceMaker(
        actor,
        critic,
        reward,
        reference,
        sampling=SamplingConfig(max_new_tokens=6, temperature=TEMPERATURE),
        eos_token_id=EOS,
        pad_token_id=PAD,
        **kwargs,
    )
    ids, mask = left_padded(PROMPTS)
    return maker.make_experience(ids, mask, generator=torch.Generator().manual_seed(seed))


def test_make_experience_gives_a_valid_unscored_experience(parts):
    experience = make(parts)
    experience.validate()
    assert experience.batch_size == 4 and experience.prompt_length == 4
    assert not experience.is_scored and experience.rewards is None
    # This seed gives the cases that matter: EOS as the first token, EOS mid-way, truncation.
    assert experience.action_mask.sum(dim=1).tolist() == [4, 6, 1, 6]
    assert experience.sequences[2, 4].item() == EOS and experience.sequences[0, 7].item() == EOS
    assert EOS not in experience.sequences[1, 4:].tolist()
    ids, mask = left_padded(PROMPTS)
    assert torch.equal(experience.sequences[:, :4], ids) and torch.equal(experience.attention_mask[:, :4], mask)
    assert torch.equal(experience.attention_mask[:, 4:], experience.action_mask.long())
    for name in ("old_logprobs", "ref_logprobs", "old_values"):
        assert bool((getattr(experience, name)[~experience.action_mask] == 0).all()), name


def test_fields_equal_their_definitions(parts):
    actor, reference, critic = parts
    experience = make(parts)
    sequences, attention_mask, action_mask = experience.sequences, experience.attention_mask, experience.action_mask
    positions = position_ids_from_mask(attention_mask)
    with torch.no_grad():
        # rollout log-probs: the actor's training-time forward at the sampling temperature
        actor_logits = actor(input_ids=sequences, attention_mask=attention_mask, position_ids=positions).logits
        actor_logprobs = response_logprobs(actor_logits, sequences, 4, temperature=TEMPERATURE)
        # reference log-probs: the same computation with the reference model
        ref_logits = reference(input_ids=sequences, attention_mask=attention_mask, position_ids=positions).logits
        ref_logprobs = response_logprobs(ref_logits, sequences, 4, temperature=TEMPERATURE)
        # values: the critic's output at the position just before each action
        values = response_slice(critic(sequences, attention_mask), 4)
    torch.testing.assert_close(experience.old_logprobs, actor_logprobs * action_mask, **CLOSE)
    torch.testing.assert_close(experience.ref_logprobs, ref_logprobs * action_mask, **CLOSE)
    torch.testing.assert_close(experience.old_values, values * action_mask, **CLOSE)
    torch.testing.assert_close(
        experience.ref_logprobs,
        sequence_logprobs(reference, sequences, attention_mask, 4, temperature=TEMPERATURE) * action_mask,
        **CLOSE,
    )
    assert (experience.ref_logprobs - experience.old_logprobs)[action_mask].abs().max() > 1e-3
    torch.testing.assert_close(experience.scores, count_score(sequences, attention_mask), rtol=0.0, atol=0.0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_issue42_another_critics_values_of_the_rows_are_what_a_rollout_with_that_critic_stores(parts, precision):
    """An overlapped update's starting critic values the rows its rollout sampled with another critic: the values equal
    the ones a rollout by that critic stores for the same rows (one computation, in the rollout's precision), whatever
    the rows per forward pass, and 0 at padding."""
    actor, reference, critic = parts
    experience = make(parts, precision=precision)
    for batch_size in (1, 3, 4):  # one row at a time, a batch that splits the rows, all of them
        values = compute_values(critic, experience, batch_size=batch_size, precision=precision)
        torch.testing.assert_close(values, experience.old_values, rtol=0.0, atol=1e-6)
    torch.manual_seed(2)
    newer = Critic(config=tiny_config("gpt2"))
    recomputed = compute_values(newer, experience, batch_size=3, precision=precision)
    with_newer = make((actor, reference, newer), precision=precision)  # the same seed samples the same rows
    assert torch.equal(with_newer.sequences, experience.sequences)
    torch.testing.assert_close(recomputed, with_newer.old_values, rtol=0.0, atol=1e-6)
    assert (recomputed - experience.old_values)[experience.action_mask].abs().min() > 0  # another critic's values
    assert bool((recomputed[~experience.action_mask] == 0).all()) and newer.training  # its mode is put back


def test_a_reward_model_reads_the_last_action_token(parts):
    torch.manual_seed(2)
    reward_model = RewardModel(config=tiny_config("gpt2")).eval()
    experience = make(parts, reward=reward_model)
    last_column = experience.prompt_length + last_action_index(experience.action_mask)  # (B,)
    for row in range(experience.batch_size):  # score of the sequence cut right after its last action
        cut = experience.sequences[row, : int(last_column[row]) + 1][
            experience.attention_mask[row, : int(last_column[row]) + 1].bool()
        ]
        with torch.no_grad():
            alone = reward_model(cut[None])
        torch.testing.assert_close(experience.scores[row : row + 1], alone, **CLOSE)


def test_models_are_left_in_their_modes(parts):
    actor, reference, critic = parts
    actor.train()
    critic.train()
    try:
        make(parts)
        assert actor.training and critic.training and not reference.training
    finally:
        actor.eval()
        critic.eval()


def test_the_score_lands_on_the_last_action_token(parts):
    config = AdvantageConfig(kl_coef=0.0, normalize_scores=False)
    scored = score_experience(make(parts), config)
    expected = torch.zeros_like(scored.rewards)
    expected[torch.arange(4), last_action_index(scored.action_mask)] = scored.scores
    torch.testing.assert_close(scored.rewards, expected, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_score_experience_equals_shaped_rewards_then_gae_by_hand(parts, estimator):
    experience = make(parts)
    config = AdvantageConfig(
        kl_coef=0.1, kl_estimator=estimator, gamma=0.9, gae_lambda=0.8, score_clip=1.5, normalize_scores=True
    )
    scored = score_experience(experience, config, score_mean=1.0, score_std=0.5)
    scores = ((experience.scores - 1.0) / 0.5).clamp(-1.5, 1.5)  # normalise, then clip
    rewards, kl = shaped_rewards(
        scores, experience.old_logprobs, experience.ref_logprobs, experience.action_mask, kl_coef=0.1,
        estimator=estimator,
    )  # fmt: skip
    advantages, returns = compute_gae(rewards, experience.old_values, experience.action_mask, gamma=0.9, gae_lambda=0.8)
    torch.testing.assert_close(scored.rewards, rewards, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scored.kl, kl, rtol=0.0, atol=0.0)
    torch.testing.assert_close(scored.advantages, advantages, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scored.returns, returns, rtol=1e-6, atol=1e-6)
    # the rollout fields are untouched and the input experience is not modified
    assert torch.equal(scored.old_values, experience.old_values) and experience.rewards is None


def test_normalisation_uses_the_given_statistics_and_only_when_asked(parts):
    experience = make(parts)
    off = AdvantageConfig(kl_coef=0.0, normalize_scores=False)
    on = AdvantageConfig(kl_coef=0.0, normalize_scores=True)
    last = last_action_index(experience.action_mask)
    rows = torch.arange(4)
    raw = score_experience(experience, off, score_mean=3.0, score_std=2.0).rewards[rows, last]
    normalised = score_experience(experience, on, score_mean=3.0, score_std=2.0).rewards[rows, last]
    torch.testing.assert_close(raw, experience.scores, rtol=0.0, atol=0.0)
    torch.testing.assert_close(normalised, (experience.scores - 3.0) / 2.0, rtol=1e-6, atol=1e-6)


def test_rescoring_a_scored_experience_recomputes_every_scored_field(parts):
    first = score_experience(make(parts), AdvantageConfig(kl_coef=0.0, normalize_scores=False))
    second = score_experience(first, AdvantageConfig(kl_coef=0.5, normalize_scores=False))
    assert not torch.equal(first.rewards, second.rewards)
    again = score_experience(second, AdvantageConfig(kl_coef=0.0, normalize_scores=False))
    for name in ("rewards", "kl", "advantages", "returns"):
        torch.testing.assert_close(getattr(again, name), getattr(first, name), rtol=0.0, atol=0.0)


# ----------------------------------------------------------------------------- without a critic


def test_without_a_critic_no_values_are_computed(parts):
    actor, reference, _ = parts
    maker = ExperienceMaker(
        actor,
        None,
        count_score,
        reference,
        sampling=SamplingConfig(max_new_tokens=6, temperature=TEMPERATURE),
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    ids, mask = left_padded(PROMPTS)
    groups = torch.tensor([3, 3, 8, 8])
    experience = maker.make_experience(ids, mask, group_ids=groups, generator=torch.Generator().manual_seed(24))
    with_critic = make(parts)  # the same seed samples the same tokens
    assert experience.old_values is None and torch.equal(experience.group_ids, groups)
    assert torch.equal(experience.sequences, with_critic.sequences)
    assert torch.equal(experience.scores, with_critic.scores)


# ----------------------------------------------------------------------------- critic-free estimators, by hand


def hand_experience() -> Experience:
    """Two prompts with two samples each; d = logprobs - ref_logprobs per valid token (k1 = d):
    row 0 [0.2, 0.1], row 1 [0.3 | pad], row 2 [0, 0], row 3 [-0.1, 0.4]; scores [1, 3, 2, 2]."""
    f64 = torch.float64
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    ref = torch.tensor([[-1.0, -2.0], [-1.5, 0.0], [-0.5, -0.7], [-1.2, -0.9]], dtype=f64)
    d = torch.tensor([[0.2, 0.1], [0.3, 0.0], [0.0, 0.0], [-0.1, 0.4]], dtype=f64)
    sequences = torch.tensor([[5, 6, 7], [5, 8, PAD], [9, 6, 7], [9, 8, 6]])
    return Experience(
        sequences=sequences,
        attention_mask=torch.cat([torch.ones(4, 1, dtype=torch.long), mask.long()], dim=1),
        action_mask=mask,
        old_logprobs=torch.where(mask, ref + d, 0.0),
        ref_logprobs=torch.where(mask, ref, 0.0),
        old_values=None,
        scores=torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=f64),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )


EXACTISH = dict(rtol=1e-12, atol=1e-12)


def test_rloo_with_the_kl_in_the_reward_by_hand():
    # kl_coef 0.5: KL penalties -0.5 * d = row 0 [-0.1, -0.05], row 1 [-0.15], row 2 [0, 0], row 3 [0.05, -0.2];
    # still to come from each token: row 0 [-0.15, -0.05], row 1 [-0.15], row 2 [0, 0], row 3 [-0.15, -0.2].
    # RLOO: group 0 (scores 1, 3): 1 - 3 = -2, 3 - 1 = 2; group 1 (2, 2): 0, 0.
    # Rewards (penalty + score on the last token): [-0.1, 0.95], [2.85 | 0], [0, 2], [0.05, 1.8];
    # returns (reward-to-go): [0.85, 0.95], [2.85 | 0], [2, 2], [1.85, 1.8].
    config = AdvantageConfig(estimator="rloo", kl_coef=0.5, normalize_scores=False)
    scored = score_experience(hand_experience(), config)
    f64 = torch.float64
    expected_advantages = torch.tensor([[-2.15, -2.05], [1.85, 0.0], [0.0, 0.0], [-0.15, -0.2]], dtype=f64)
    torch.testing.assert_close(scored.advantages, expected_advantages, **EXACTISH)
    expected_rewards = torch.tensor([[-0.1, 0.95], [2.85, 0.0], [0.0, 2.0], [0.05, 1.8]], dtype=f64)
    torch.testing.assert_close(scored.rewards, expected_rewards, **EXACTISH)
    expected_returns = torch.tensor([[0.85, 0.95], [2.85, 0.0], [2.0, 2.0], [1.85, 1.8]], dtype=f64)
    torch.testing.assert_close(scored.returns, expected_returns, **EXACTISH)


@pytest.mark.parametrize(
    ("estimator", "outcome"),
    [("rloo", [-2.0, 2.0, 0.0, 0.0]), ("dr_grpo", [-1.0, 1.0, 0.0, 0.0]), ("grpo", [-1 / 2**0.5, 1 / 2**0.5, 0, 0])],
)
def test_with_the_kl_in_the_loss_a_group_advantage_is_its_outcome_at_every_token(estimator, outcome):
    # Group 0 (1, 3): mean 2, centred [-1, 1], unbiased std sqrt(2); group 1 (2, 2): all 0. No KL in the reward.
    config = AdvantageConfig(estimator=estimator, kl_coef=0.5, kl_in="loss", normalize_scores=False)
    scored = score_experience(hand_experience(), config)
    mask = scored.action_mask
    expected = torch.where(mask, torch.tensor(outcome, dtype=torch.float64)[:, None].expand(4, 2), 0.0)
    torch.testing.assert_close(scored.advantages, expected, rtol=1e-6, atol=1e-6)
    # the reward holds only the score (on the last token); the KL column still reports the estimate
    torch.testing.assert_close(scored.rewards.sum(dim=1), scored.scores, **EXACTISH)
    torch.testing.assert_close(scored.kl[0], torch.tensor([0.2, 0.1], dtype=torch.float64), **EXACTISH)


def test_reinforce_pp_whitens_the_return_of_the_shaped_rewards():
    from rlhf_core.masked import masked_whiten

    config = AdvantageConfig(estimator="reinforce_pp", kl_coef=0.5, normalize_scores=False)
    scored = score_experience(hand_experience(), config)
    # returns as in the RLOO case above: [0.85, 0.95], [2.85 | 0], [2, 2], [1.85, 1.8]
    expected_returns = torch.tensor([[0.85, 0.95], [2.85, 0.0], [2.0, 2.0], [1.85, 1.8]], dtype=torch.float64)
    torch.testing.assert_close(scored.returns, expected_returns, **EXACTISH)
    torch.testing.assert_close(scored.advantages, masked_whiten(expected_returns, scored.action_mask), **EXACTISH)


def test_the_adaptive_coefficient_overrides_the_configured_one():
    config = AdvantageConfig(estimator="reinforce_pp", kl_coef=0.5, normalize_scores=False)
    overridden = score_experience(hand_experience(), config, kl_coef=0.25)
    direct = score_experience(
        hand_experience(), AdvantageConfig(estimator="reinforce_pp", kl_coef=0.25, normalize_scores=False)
    )
    torch.testing.assert_close(overridden.rewards, direct.rewards, **EXACTISH)


def test_gae_needs_values_and_group_estimators_need_groups():
    with pytest.raises(ValueError, match="`gae` needs the critic's values"):
        score_experience(hand_experience(), AdvantageConfig())
    with pytest.raises(ValueError, match="`grpo` needs `group_ids`"):
        score_experience(hand_experience().replace(group_ids=None), AdvantageConfig(estimator="grpo"))


# ----------------------------------------------------------------------------- episodes (issue 44)


def episode_batch(parts) -> Experience:
    """Two episodes of one prompt: row 0 [model 13, 14 | environment 20, 21 | model 15, EOS], reward 0.5 then 1;
    row 1 [model 16 | environment 22 | model 17 | padding], its environment failed after turn 2 (reward -1 then 0):
    kept, with no model token (out of the loss)."""
    actor, reference, critic = parts
    prompt, prompt_mask = left_padded([[3, 4, 5], [3, 4, 5]])
    response = torch.tensor([[13, 14, 20, 21, 15, EOS], [16, 22, 17, PAD, PAD, PAD]])
    window = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    actions = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    return episode_experience(
        actor,
        critic,
        reference,
        torch.cat([prompt, response], dim=1),
        torch.cat([prompt_mask, window], dim=1),
        actions,
        turn_rewards=torch.tensor([[0.5, 1.0], [-1.0, 0.0]]),
        engine_logprobs=torch.zeros(2, 6),
        group_ids=torch.tensor([7, 7]),
        temperature=TEMPERATURE,
    )


def test_an_episode_takes_one_forward_pass_over_its_whole_window_and_scores_its_turns(parts):
    actor, reference, critic = parts
    experience = episode_batch(parts)
    assert torch.equal(experience.scores, torch.tensor([1.5, -1.0]))  # the sum of its turn rewards
    whole = sequence_logprobs(actor, experience.sequences, experience.attention_mask, 3, temperature=TEMPERATURE)
    torch.testing.assert_close(experience.old_logprobs, torch.where(experience.action_mask, whole, 0.0), **CLOSE)
    config = AdvantageConfig(estimator="gae", kl_coef=0.1)
    scored = score_experience(experience, config)
    rewards, kl = episode_shaped_rewards(
        experience.turn_rewards, experience.old_logprobs, experience.ref_logprobs, experience.action_mask, kl_coef=0.1
    )
    expected = episode_gae(rewards, experience.old_values, experience.action_mask, gamma=1.0, gae_lambda=0.95)
    torch.testing.assert_close(scored.advantages, expected.advantages, rtol=0.0, atol=0.0)
    for name in ("advantages", "returns", "rewards", "kl"):  # nothing at the environment's tokens, nor the failed row
        assert bool((getattr(scored, name)[~experience.action_mask] == 0).all()), name
    # The turn rewards land on each turn's last model token (columns 1 and 5), with the KL penalty on every one.
    torch.testing.assert_close(scored.rewards[0, [1, 5]] + 0.1 * kl[0, [1, 5]], torch.tensor([0.5, 1.0]), **CLOSE)
    # GRPO: the failed episode stays in its group with its reward (-1 against 1.5), and takes no advantage itself.
    grpo = score_experience(experience, AdvantageConfig(estimator="grpo", kl_coef=0.0))
    assert bool((grpo.advantages[0, experience.action_mask[0]] > 0).all()) and not grpo.advantages[1].any()
