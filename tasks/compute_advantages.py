"""Stage 5, compute rewards, KL and advantages: pure, so replaying it with new settings is cheap.

With ``advantages.kl_target`` set, the KL coefficient is the adaptive controller's (Ziegler et al.
2019): this stage shapes with the coefficient the previous iteration's stage 5 handed on (or
``advantages.kl_coef`` at the start), records it as ``kl_coef``, and records the next one,
updated from the KL it measured here, as ``next_kl_coef``. The previous iteration's output is an
upstream of this one, so resuming, continuing and replaying all start from the coefficient the
data carries, never from a value kept in memory. With ``advantages.score_statistics`` ``running`` the running
moments of the reward model's scores are carried the same way (:data:`RUNNING_MOMENTS`), while the reward model
stays the same (a pretrained one used as it is). In an overlapped iteration whose rollout took its values from an
older policy's critic, the values are those of the critic the update starts from (``critic_values``, an output of
:mod:`tasks.critic_values`), read in place of the experience's: the scored experience carries them, so the update's
value clip is around them too.
"""

from __future__ import annotations

import dataclasses

from rlhf_core.advantages import adaptive_kl_coef
from rlhf_core.config import AdvantageConfig
from rlhf_core.experience_maker import score_experience
from rlhf_core.masked import masked_mean
from rlhf_core.rewards import ScoreMoments, update_moments
from runtime.declaration import StageResult
from runtime.job import Job
from runtime.stage import Stage
from storage.experience_io import experience_to_table, table_to_experience, with_values
from storage.schemas import SCORED_EXPERIENCE
from storage.shards import read_table
from tasks.settings import ComputeAdvantagesSettings

NEXT_KL_COEF = "next_kl_coef"
"""The metric that hands the adaptive controller's coefficient to the next iteration's stage 5."""
RUNNING_MOMENTS = ("score_count", "score_running_mean", "score_running_m2")
"""The metrics that hand the running moments of every rollout's scores so far to the next iteration's stage 5."""


def starting_kl_coef(advantages: AdvantageConfig, previous: StageResult | None) -> float:
    """The reward's KL coefficient for this iteration: the controller's carried value when it is on and
    the previous iteration handed one on, else the configured ``kl_coef``."""
    if advantages.kl_target is not None and previous is not None and NEXT_KL_COEF in previous.metrics:
        return previous.metrics[NEXT_KL_COEF]
    return advantages.kl_coef


def previous_moments(previous: StageResult | None, *, reward_model_retrained: bool) -> ScoreMoments | None:
    """The running moments of the scores the previous iteration's stage 5 handed on, or None: none yet, or the
    reward model is retrained every iteration (``reward_model.train``), so the previous moments are another
    model's scores, on a scale of their own (TRL's score scaling likewise assumes one reward model). Only a
    pretrained reward model used as it is carries its moments from iteration to iteration."""
    if previous is None or RUNNING_MOMENTS[0] not in previous.metrics or reward_model_retrained:
        return None
    count, mean, m2 = (previous.metrics[name] for name in RUNNING_MOMENTS)
    return ScoreMoments(int(count), mean, m2)


def work(job: Job[ComputeAdvantagesSettings]) -> dict[str, float]:
    """Write the ``scored_experience`` table: per-token rewards, KL, advantages and returns."""
    settings = job.settings
    table = read_table(settings.experience.directory, "experience")
    if settings.critic_values is not None:  # the update's starting critic's values of an overlapped rollout's rows
        table = with_values(table, read_table(settings.critic_values.directory, "critic_values"))
    # Only masks and per-token floats are read here and padding is stripped again on write,
    # so the id used to pad token columns cannot change the output.
    rollouts = table_to_experience(table, pad_token_id=0)
    advantages, reward_model = settings.advantages, settings.reward_model
    kl_coef = starting_kl_coef(advantages, settings.previous)
    carried = {}
    if reward_model is None:  # a reward function has no held-out score statistics: its scores are used as they are
        advantages = dataclasses.replace(advantages, normalize_scores=False)
        score_mean, score_std = 0.0, 1.0
    elif advantages.score_statistics == "running":
        before = previous_moments(settings.previous, reward_model_retrained=settings.reward_model_retrained)
        moments = update_moments(before, rollouts.scores)
        score_mean, score_std = moments.mean, moments.std
        carried = dict(zip(RUNNING_MOMENTS, map(float, moments), strict=True))
    elif "score_mean" in reward_model.metrics:  # the reward model's held-out statistics
        score_mean, score_std = reward_model.metrics["score_mean"], reward_model.metrics["score_std"]
    else:
        # A pretrained reward model used as it is has none, so the experience's own scores stand in
        # (a pure function of the shards all the same).
        score_mean = float(rollouts.scores.mean())
        score_std = float(rollouts.scores.std()) if rollouts.batch_size > 1 else 1.0
    scored = score_experience(rollouts, advantages, score_mean=score_mean, score_std=score_std, kl_coef=kl_coef)
    job.out.write_table(
        "scored_experience",
        experience_to_table(scored, first_row=table.column("row")[0].as_py()),
        schema=SCORED_EXPERIENCE,
        rows_per_shard=settings.rows_per_shard,
    )
    mask = scored.action_mask
    kl_mean = float(scored.kl.sum(dim=1).mean())
    metrics = {
        "kl_mean": kl_mean,
        "kl_coef": kl_coef if advantages.kl_in == "reward" else 0.0,
        "reward_mean": float(scored.rewards.sum(dim=1).mean()),
        "advantage_mean": float(masked_mean(scored.advantages, mask)),
        "return_mean": float(masked_mean(scored.returns, mask)),
        **carried,
    }
    if advantages.kl_target is not None:
        metrics[NEXT_KL_COEF] = adaptive_kl_coef(
            kl_coef, kl_mean, target=advantages.kl_target, horizon=advantages.kl_horizon, steps=scored.batch_size
        )
    return metrics


compute_advantages = Stage(ComputeAdvantagesSettings, work=work)
