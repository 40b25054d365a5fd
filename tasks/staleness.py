"""Policy versions as the stages see them: the version of a policy output, and the PPO update's view of the rows an
older policy sampled (``sampling.staleness``, :mod:`rlhf_core.off_policy`).

Choices:
1. A policy's version is the number of updates behind it, read from its output: 0 for the campaign's initial policy
   (``initialize``), ``iteration + 1`` for the one the update of ``iteration`` wrote (a replay's too). Nothing new is
   stored for it, so outputs written before versions existed have one as well.
2. The rollout writes its policy's version in every row; the update subtracts each row's from its own starting
   policy's, refuses rows staler than ``sampling.staleness``, and under decoupled PPO computes the log-probs of its
   starting policy (pi_prox) once, before its first step, with its own forward.
3. A crashed update continues from a mid-stage checkpoint whose actor has moved on, so pi_prox cannot be computed
   again from it: it is kept beside the checkpoints (``<output>.partial/prox_logprobs.safetensors``, written whole
   under a temporary name before the first step, so before any checkpoint) and read back whenever the
   :class:`runtime.checkpointer.Checkpointer` resumes one. Every training process decides alike whether to read it or
   compute it (whether the checkpointer found a checkpoint), so a sharded forward is run by all of them or by none.
   The ``.partial`` folder goes when the output is finished, pi_prox with it.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from rlhf_core.experience import Experience
from rlhf_core.off_policy import check_staleness, off_policy_stats, proximal_logprobs, row_staleness
from runtime.declaration import StageResult
from storage.files import temporary_sibling
from storage.manifest import read_manifest
from storage.progress import partial_dir
from tasks.settings import PPOUpdateSettings

PROX_FILE = "prox_logprobs.safetensors"


def policy_version(policy: StageResult) -> int:
    """The version of the policy output ``policy`` (choice 1).

    Raises:
        ValueError: ``policy`` is not a policy output (``initialize`` or ``ppo_update``).
    """
    if policy.stage == "initialize":
        return 0
    if policy.stage != "ppo_update":
        raise ValueError(f"a policy is an initialize or ppo_update output, not a {policy.stage} one")
    return int(read_manifest(policy.directory, verify=False).config["context"]["iteration"]) + 1


def with_proximal_logprobs(
    settings: PPOUpdateSettings,
    experience: Experience,
    actor: PreTrainedModel,
    final_dir: Path,
    *,
    resumed: bool,
    main: bool,
) -> tuple[Experience, dict[str, float]]:
    """``experience`` with the ``prox_logprobs`` its update needs (none when every row is on-policy, or with
    ``ppo.off_policy`` behaviour), and the update's off-policy metrics (choices 2 and 3).

    Args:
        actor: the policy the update starts from (``resumed`` False), prepared for training.
        final_dir: the update's output folder (pi_prox is kept in its ``.partial`` sibling).
        resumed: the update continues from a mid-stage checkpoint: pi_prox is read back, never computed.
        main: this is the process that writes.

    Raises:
        ValueError: a row is staler than ``sampling.staleness`` (or newer than the update's policy).
    """
    ppo = settings.ppo
    staleness = row_staleness(experience.policy_versions, policy_version(settings.policy), rows=experience.batch_size)
    check_staleness(staleness, bound=settings.staleness)
    if ppo.off_policy == "decoupled" and bool((staleness > 0).any()):
        kept = partial_dir(final_dir) / PROX_FILE
        if resumed:
            prox = load_file(kept)["prox_logprobs"]
        else:
            prox = proximal_logprobs(
                actor, experience, temperature=settings.temperature, batch_size=ppo.minibatch_size
            ).cpu()
            if main:
                kept.parent.mkdir(parents=True, exist_ok=True)
                staging = temporary_sibling(kept)
                save_file({"prox_logprobs": prox.contiguous()}, staging)
                staging.replace(kept)
        experience = experience.replace(prox_logprobs=prox.to(experience.device))
    stats = off_policy_stats(experience, staleness, cap=ppo.behaviour_weight_cap)
    return experience, {name: float(value) for name, value in stats._asdict().items()}
