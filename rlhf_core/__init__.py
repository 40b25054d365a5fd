"""rlhf_core: the pure core of the pipeline: models, maths, generation and training loops.

It imports only torch, transformers, accelerate and the standard library, so every formula can
be tested and reused without Prefect, MLflow or a file format in sight.

Shape legend, used in every ``Shapes:`` docstring line and trailing ``# (B, R)`` comment:

    ====  ===================================
    B     batch (rows or rollouts)
    P     prompt length (left-padded)
    R     response length (right-padded)
    T     P + R
    V     vocabulary size
    H     hidden size
    N     candidates per prompt
    G     samples per prompt in a rollout (a group)
    ====  ===================================

Conventions:

* A sequence is ``[left-padded prompt | right-padded response]``, shape ``(B, T)``. Response
  token ``t`` sits at column ``P + t`` for every row.
* ``action_mask: bool (B, R)`` is True for each generated token up to and including EOS.
  An episode's ``model_mask`` is True at the model's tokens of every turn, with gaps at the
  environment's tokens (:mod:`rlhf_core.episodes`).
* Index ``t`` of any ``(B, R)`` tensor means response token ``t``. The logits/token off-by-one
  (logits at position ``i`` score token ``i + 1``) is handled only in
  :func:`rlhf_core.sequences.response_logprobs` and :func:`rlhf_core.sequences.response_slice`.
* Every reduction over tokens goes through :mod:`rlhf_core.masked`.
"""

from __future__ import annotations

__all__ = [
    "advantages",
    "config",
    "distributed",
    "divergence",
    "dpo",
    "episodes",
    "errors",
    "evaluation",
    "experience",
    "experience_maker",
    "gae",
    "generation",
    "gguf",
    "loading",
    "losses",
    "masked",
    "models",
    "mismatch",
    "off_policy",
    "packing",
    "ppo",
    "precision",
    "preference_losses",
    "reward_training",
    "sft",
    "rewards",
    "sequences",
]
