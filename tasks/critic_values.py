"""The values of the critic an overlapped update starts from, for the rows its rollout sampled: computed once, kept
beside the experience, and read by stage 5 in place of the rollout's own.

Choices:
1. With ``sampling.staleness`` >= 1 an iteration's rollout samples an older policy and scores its rows with that
   policy's critic, while the update starts from a newer one (:mod:`flows.overlap`). GAE and the update's value clip
   want the values of the critic being trained, before its first step (verl's trainer calls ``compute_values`` with
   the critic it trains, before ``compute_advantage``), so this stage runs that critic over the stored rows. The flow
   runs it only where the two critics differ (:func:`flows.rlhf_pipeline._critic_values`): elsewhere the rollout's
   values are the starting critic's already.
2. The values are computed as the rollout computes its own (:func:`rlhf_core.experience_maker.compute_values`: the
   frozen critic in eval mode, in ``precision``), so a sequential campaign's update and an overlapped one read values
   of the same computation, only of another critic.
3. A stage of its own, not a step inside stage 5 or the update: stage 5 stays a pure function of Parquet (a replay with
   another ``gamma`` reads these values back and runs no critic), and the update's value clip reads the scored
   experience's ``old_values``, these.
4. ``value_shift_mean`` records how far the rollout's critic was: the mean over action tokens of the absolute
   difference between these values and the rollout's.
"""

from __future__ import annotations

import pyarrow as pa
import torch

from rlhf_core.experience_maker import compute_values
from rlhf_core.masked import masked_mean
from runtime.job import Job
from runtime.stage import Stage
from storage.experience_io import experience_to_table, table_to_experience
from storage.schemas import CRITIC_VALUES, OLD_VALUES, ROW
from storage.shards import read_table
from tasks.settings import CriticValuesSettings, critic_folder, critic_score_statistics


def value_shift(values: torch.Tensor, rollout_values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """The mean absolute difference between two critics' values over the action tokens (choice 4).

    Naive equivalent: ``mean(abs(v - r) for v, r, m in zip(values, rollout_values, mask) if m)``.

    Shapes:
        values, rollout_values, action_mask: (B, R); returns ().
    """
    return masked_mean((values - rollout_values).abs(), action_mask)


def work(job: Job[CriticValuesSettings]) -> dict[str, float]:
    """Write the :data:`storage.schemas.CRITIC_VALUES` table of the experience's rows."""
    settings = job.settings
    models = job.models(settings.precision)
    policy = settings.policy.directory
    critic = models.load(
        "critic",
        critic_folder(policy, settings.critic_start),
        score_statistics=critic_score_statistics(policy, settings.critic_start),
    )
    table = read_table(settings.experience.directory, "experience")
    # Only masks and positions reach the critic, and the attention mask hides padding: its id changes no value.
    experience = table_to_experience(table, pad_token_id=0)
    on_device = experience.to(models.device)
    values = compute_values(critic, on_device, batch_size=settings.batch_size, precision=models.precision).cpu()
    stored = experience_to_table(experience.replace(old_values=values))
    output = pa.table({ROW: table.column(ROW), OLD_VALUES: stored.column(OLD_VALUES)}, schema=CRITIC_VALUES)
    job.out.write_table("critic_values", output, schema=CRITIC_VALUES, rows_per_shard=settings.rows_per_shard)
    metrics = {"rows": float(table.num_rows)}
    if experience.old_values is not None:
        metrics["value_shift_mean"] = float(value_shift(values, experience.old_values, experience.action_mask))
    return metrics


critic_values = Stage(CriticValuesSettings, work=work)
