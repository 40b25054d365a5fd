"""What samples in a generation stage (``sampling.engine``), and the mismatch its log-probs leave.

``hf`` samples with the stage's actor and the shard's generator, as always. ``vllm`` samples in the long-lived
engine (:mod:`runtime.engine`), serving the actor folder the stage was given, with one seed per row
(:meth:`runtime.fanout.Shard.row_seeds`); the stage then recomputes the log-probs of the sampled tokens with the
actor (the trainer's numerics) and records how far the engine's are from them.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch
from transformers import PreTrainedModel

from rlhf_core.config import SamplingConfig
from rlhf_core.loading import ModelLoader
from rlhf_core.mismatch import logprob_mismatch
from runtime.context import StageContext
from runtime.engine_client import ServedPolicy, served_policy
from runtime.shards import Shard
from storage.schemas import ENGINE_LOGPROBS, OLD_LOGPROBS


def policy_sampler(
    models: ModelLoader, context: StageContext, actor_dir: str | Path, actor: PreTrainedModel, sampling: SamplingConfig
) -> PreTrainedModel | ServedPolicy:
    """What :func:`rlhf_core.generation.generate` samples with: the actor, or the engine serving its folder."""
    if sampling.engine == "hf":
        return actor
    return served_policy(actor_dir, context.execution.engine_url, bases=models.bases)


def row_seeds(sampling: SamplingConfig, shard: Shard, first_row: int, rows: int) -> list[int] | None:
    """The engine's per-row seeds of output rows ``first_row ..`` (None for ``hf``, which draws from the shard's
    generator)."""
    return None if sampling.engine == "hf" else shard.row_seeds(range(first_row, first_row + rows))


def mismatch_metrics(table: pa.Table) -> dict[str, float]:
    """``engine_logprob_max_abs_diff`` and ``token_mult_prob_error`` over every token of the rows of ``table`` that
    hold both ``old_logprobs`` and ``engine_logprobs`` (:func:`rlhf_core.mismatch.logprob_mismatch`); none when no
    row does."""
    both = [
        (old, engine)
        for old, engine in zip(
            table.column(OLD_LOGPROBS).to_pylist(), table.column(ENGINE_LOGPROBS).to_pylist(), strict=True
        )
        if old is not None and engine is not None
    ]
    old = torch.tensor([value for row, _ in both for value in row], dtype=torch.float32).unsqueeze(0)  # (1, N)
    engine = torch.tensor([value for _, row in both for value in row], dtype=torch.float32).unsqueeze(0)  # (1, N)
    if old.numel() == 0:
        return {}
    mismatch = logprob_mismatch(old, engine, torch.ones_like(old, dtype=torch.bool))
    return {
        "engine_logprob_max_abs_diff": float(mismatch.max_abs_diff),
        "token_mult_prob_error": float(mismatch.token_mult_prob_error),
    }
