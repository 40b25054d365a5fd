"""Stage 6, PPO update: new actor and critic checkpoints from the scored experience.

With a critic-free estimator (``critic`` False) the actor alone is loaded, trained and saved: the
new policy has no ``critic/``, and neither have the policies after it.

The update saves its progress after an epoch, at most every ``checkpoint_seconds`` (models,
optimizers, the shuffling stream and running statistics: :mod:`runtime.checkpointer`); a crashed run
continues from the last saved epoch, on any number of processes, and ends where an uninterrupted one would
(exactly, on as many). Under decoupled PPO the log-probs of its starting policy (pi_prox) for rows an older policy
sampled are kept in the same ``.partial`` folder before the first step and read back on resume
(:mod:`tasks.staleness`).

The optimizer states it writes (``optimizers/``) are *prunable*: only the newest iteration's are needed (to continue
the campaign), so older ones are deleted (:func:`prune_optimizer_states`). An update continues the
optimizer states of its input policy, and their digest is part of its input key
(:class:`OptimizerState`): re-running a finished iteration reuses its output even after its
input's states were pruned, while computing it again then is refused (it could not be exact). A
replay continues them while they exist, and otherwise starts from fresh optimizers, under another key.

With ``execution.training_processes`` N > 1 the update runs in N ``accelerate launch`` processes (or Ray Train
workers), each on its share of every minibatch (:mod:`runtime.launch`, :mod:`rlhf_core.distributed`), the models
sharded over them under FSDP2 (:mod:`runtime.checkpointer`); the main process writes the models.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from rlhf_core.ppo import PPOProgress
from rlhf_core.ppo import ppo_update as update
from runtime.checkpointer import OPTIMIZERS, Checkpointer
from runtime.declaration import StageResult
from runtime.job import Job, Training
from runtime.models import accelerator_for
from runtime.stage import Stage
from storage.experience_io import table_to_experience
from storage.manifest import prunable_digest, prunable_present, prune_files, read_manifest
from storage.progress import latest_progress
from storage.shards import read_table
from tasks.settings import OptimizerState, PPOUpdateSettings, critic_folder, critic_score_statistics
from tasks.staleness import with_proximal_logprobs
from tasks.text import load_tokenizer


def optimizer_state(policy: StageResult, *, present_only: bool = False) -> OptimizerState | None:
    """The optimizer states ``policy`` (an initialize or ppo_update output) was written with, or None
    when it has none (or, with ``present_only``, when they were pruned)."""
    manifest = read_manifest(policy.directory, verify=False)
    digest = prunable_digest(manifest)
    if digest is None:
        return None
    present = prunable_present(policy.directory, manifest)
    return OptimizerState(path=policy.path, digest=digest, present=present) if present or not present_only else None


def prune_optimizer_states(folders: list[Path], *, keep: Path | None) -> int:
    """Delete the optimizer states of the ppo_update outputs ``folders`` except ``keep``; returns the bytes freed."""
    return sum(prune_files(folder) for folder in folders if keep is None or folder.resolve() != keep.resolve())


def plan(job: Job[PPOUpdateSettings]) -> Training:
    """Refuse what cannot be trained (a critic the policy lacks; optimizer states pruned since), before any training
    process starts; then train in this process, or in ``execution.training_processes`` launched ones."""
    settings, out = job.settings, job.out
    policy, optimizer = settings.policy, settings.optimizer
    if settings.critic and not critic_folder(policy.directory, settings.critic_start).is_dir():
        raise ValueError(
            f"advantages.estimator gae trains a critic, but the policy in {policy.directory} has none (it was "
            "trained by a critic-free estimator): keep a critic-free estimator, or start a new campaign"
        )
    if optimizer is not None and not optimizer.present and latest_progress(out.final_dir) is None:
        raise FileNotFoundError(
            f"the optimizer states of {optimizer.path} were pruned (only the newest iteration keeps them), so this "
            "update cannot be computed again exactly; continue from the newest iteration, or replay it"
        )
    out.prunable.add(OPTIMIZERS)
    return Training(settings.precision)


def work(job: Job[PPOUpdateSettings]) -> dict[str, float]:
    """The update itself, in each training process: the main process writes the output and its checkpoints."""
    settings, context, out = job.settings, job.context, job.out
    ppo, critic, policy, optimizer = settings.ppo, settings.critic, settings.policy, settings.optimizer
    models = job.models(settings.precision)
    accelerator = accelerator_for(models.device, models.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    generator = job.generator()
    checkpointer = Checkpointer(
        accelerator, context.execution, out.final_dir, generator=generator, epochs=ppo.epochs, name=job.stage
    )
    loaded = {"actor": models.load("actor", policy.directory / "actor", trainable=True)}
    factories = {"actor": partial(torch.optim.AdamW, lr=ppo.actor_learning_rate)}
    if critic:
        statistics = critic_score_statistics(policy.directory, settings.critic_start)
        loaded["critic"] = models.load(
            "critic",
            critic_folder(policy.directory, settings.critic_start),
            trainable=True,
            score_statistics=statistics,
        )
        factories["critic"] = partial(torch.optim.AdamW, lr=ppo.critic_learning_rate)
    # A policy continuing critic-free from a GAE one leaves the critic's optimizer state unread.
    states = Path(optimizer.path) if optimizer is not None else None
    trained, optimizers = checkpointer.prepare(loaded, factories, continues=states)
    experience = table_to_experience(
        read_table(settings.scored.directory, "scored_experience"), pad_token_id=tokenizer.pad_token_id
    )
    experience, off_policy = with_proximal_logprobs(
        settings, experience, trained["actor"], out.final_dir, resumed=checkpointer.resumed is not None,
        main=checkpointer.main,
    )  # fmt: skip
    with checkpointer:
        stats = update(
            trained["actor"], trained.get("critic"), optimizers["actor"], optimizers.get("critic"), experience, ppo,
            accelerator=accelerator, temperature=settings.temperature, norm_tokens=settings.max_new_tokens,
            generator=generator, resume=checkpointer.resume(PPOProgress), on_epoch_end=checkpointer.end_epoch,
            on_step=checkpointer.record_step,
        )  # fmt: skip
    checkpointer.save_output(out.path, tokenizer=tokenizer, keep_optimizers=True)
    return {
        **{name: float(value) for name, value in stats._asdict().items() if value is not None},
        "optimizer_restored": float(states is not None),
        **off_policy,
    }


ppo_update = Stage(PPOUpdateSettings, plan=plan, work=work, register={"actor": "actor", "critic": "critic"})
