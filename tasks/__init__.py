"""One Prefect task per stage. Each resolves its inputs, calls rlhf_core, writes through storage,
records in MLflow, and returns a small reference (a ``StageResult``), never tensors or models."""

from __future__ import annotations

from tasks.collect_preferences import collect_preferences
from tasks.compute_advantages import compute_advantages
from tasks.evaluate import evaluate
from tasks.initialize import initialize
from tasks.ppo_update import ppo_update
from tasks.rollout import rollout
from tasks.sample_candidates import sample_candidates
from tasks.train_reward_model import train_reward_model

__all__ = [
    "collect_preferences",
    "compute_advantages",
    "evaluate",
    "initialize",
    "ppo_update",
    "rollout",
    "sample_candidates",
    "train_reward_model",
]
