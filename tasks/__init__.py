"""One Prefect task per stage, each in its own module (``tasks.rollout.rollout``, ...). Each resolves its
inputs, calls rlhf_core, writes through storage, records in MLflow, and returns a small reference (a
``StageResult``), never tensors or models. The package itself imports nothing, so a command that needs one
light module (the reuse decision reads :mod:`runtime.context` and :mod:`runtime.code`) does not load every stage."""

from __future__ import annotations
