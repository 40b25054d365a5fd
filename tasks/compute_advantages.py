"""Stage 5, compute rewards, KL and GAE: pure, so replaying it with new settings is cheap."""

from __future__ import annotations

from rlhf_core.config import AdvantageConfig
from rlhf_core.experience_maker import score_experience
from rlhf_core.masked import masked_mean
from storage.experience_io import experience_to_table, table_to_experience
from storage.manifest import StageOutput
from storage.schemas import SCORED_EXPERIENCE
from storage.shards import read_table
from tasks.context import StageContext
from tasks.stage import StageResult, stage

STAGE = "compute_advantages"


@stage(STAGE)
def compute_advantages(
    out: StageOutput,
    context: StageContext,
    experience: StageResult,
    reward_model: StageResult,
    *,
    advantages: AdvantageConfig,
    rows_per_shard: int,
) -> dict[str, float]:
    """Write the ``scored_experience`` table: per-token rewards, KL, advantages and returns."""
    table = read_table(experience.directory, "experience")
    # Only masks and per-token floats are read here and padding is stripped again on write,
    # so the id used to pad token columns cannot change the output.
    rollouts = table_to_experience(table, pad_token_id=0)
    # The reward model's held-out statistics; a pretrained one used as it is has none, so the
    # experience's own scores stand in (a pure function of the shards all the same).
    statistics = reward_model.metrics
    if "score_mean" in statistics:
        score_mean, score_std = statistics["score_mean"], statistics["score_std"]
    else:
        score_mean = float(rollouts.scores.mean())
        score_std = float(rollouts.scores.std()) if rollouts.batch_size > 1 else 1.0
    scored = score_experience(rollouts, advantages, score_mean=score_mean, score_std=score_std)
    out.write_table(
        "scored_experience",
        experience_to_table(scored, table.column("prompt_id").to_pylist(), first_row=table.column("row")[0].as_py()),
        schema=SCORED_EXPERIENCE,
        rows_per_shard=rows_per_shard,
    )
    mask = scored.action_mask
    return {
        "kl_mean": float(scored.kl.sum(dim=1).mean()),
        "reward_mean": float(scored.rewards.sum(dim=1).mean()),
        "advantage_mean": float(masked_mean(scored.advantages, mask)),
        "return_mean": float(masked_mean(scored.returns, mask)),
    }
