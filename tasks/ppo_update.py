"""Stage 6, PPO update: new actor and critic checkpoints from the scored experience.

With a critic-free estimator (``critic`` False) the actor alone is loaded, trained and saved: the
new policy has no ``critic/``, and neither have the policies after it.

The update saves its progress after an epoch, at most every ``checkpoint_seconds`` (models,
optimizers, the shuffling stream and running statistics); a crashed run continues from the last
saved epoch and ends exactly where an uninterrupted one would.

The optimizer states it writes are *prunable*: only the newest iteration's are needed (to continue
the campaign), so older ones are deleted (:func:`prune_optimizer_states`). An update continues the
optimizer states of its input policy, and their digest is part of its input key
(:class:`OptimizerState`): re-running a finished iteration reuses its output even after its
input's states were pruned, while computing it again then is refused (it could not be exact). A
replay continues them while they exist, and otherwise starts from fresh optimizers, under another key.

With ``execution.training_processes`` N > 1 the update runs in N ``accelerate launch`` processes (or Ray Train
workers), each on its share of every minibatch (:mod:`runtime.launch`, :mod:`rlhf_core.distributed`), the models
sharded over them under FSDP2 (:mod:`runtime.training`); the main process writes the models.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhf_core.ppo import MinibatchStats, PPOProgress
from rlhf_core.ppo import ppo_update as update
from runtime.bars import stage_bar
from runtime.declaration import StageResult
from runtime.job import Job, Training
from runtime.metering import Throttle
from runtime.models import accelerator_for
from runtime.record import write_training_curve
from runtime.stage import Stage
from runtime.training import check_states, save_checkpoint, save_trained, train_models
from storage.experience_io import table_to_experience
from storage.manifest import prunable_digest, prunable_present, prune_files, read_manifest
from storage.progress import latest_progress
from storage.shards import read_table
from tasks.settings import OptimizerState, PPOUpdateSettings
from tasks.staleness import with_proximal_logprobs
from tasks.text import load_tokenizer

PROGRESS_FILE = "progress.json"
OPTIMIZERS = ("actor_optimizer", "critic_optimizer")


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
    if settings.critic and not (policy.directory / "critic").is_dir():
        raise ValueError(
            f"advantages.estimator gae trains a critic, but the policy in {policy.directory} has none (it was "
            "trained by a critic-free estimator): keep a critic-free estimator, or start a new campaign"
        )
    if optimizer is not None and not optimizer.present and latest_progress(out.final_dir) is None:
        raise FileNotFoundError(
            f"the optimizer states of {optimizer.path} were pruned (only the newest iteration keeps them), so this "
            "update cannot be computed again exactly; continue from the newest iteration, or replay it"
        )
    # The optimizer states the update reads: a crashed attempt's last checkpoint's, else its input policy's.
    checkpoint = latest_progress(out.final_dir)
    reads = checkpoint[1] if checkpoint else Path(optimizer.path) if optimizer is not None else None
    if reads is not None:
        check_states(job.context.execution, [reads / name for name in OPTIMIZERS])
    out.prunable.update(OPTIMIZERS)
    return Training(settings.precision)


def work(job: Job[PPOUpdateSettings]) -> dict[str, float]:
    """The update itself, in each training process: the main process writes the output and its checkpoints."""
    settings, context, out = job.settings, job.context, job.out
    ppo, critic, policy, optimizer = settings.ppo, settings.critic, settings.policy, settings.optimizer
    models = job.models(settings.precision)
    accelerator = accelerator_for(models.device, models.precision)
    main = accelerator.is_main_process
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    generator = job.generator()
    checkpoint = latest_progress(out.final_dir)
    source, resume, curve = policy.directory, None, []
    states = Path(optimizer.path) if optimizer is not None else None
    if checkpoint is not None:
        source = states = checkpoint[1]
        saved = json.loads((source / PROGRESS_FILE).read_text())
        resume = PPOProgress(**saved["progress"])
        generator.set_state(torch.tensor(saved["generator_state"], dtype=torch.uint8))
        curve = saved["curve"]
    loaded = [models.load("actor", source / "actor", trainable=True)]
    if critic:
        loaded.append(models.load("critic", source / "critic", trainable=True))
    rates = (ppo.actor_learning_rate, ppo.critic_learning_rate)
    # A policy continuing critic-free from a GAE one leaves the critic's optimizer state unread.
    folders = [None if states is None else states / name for name in OPTIMIZERS[: len(loaded)]]
    trained, _ = train_models(
        accelerator, context.execution, loaded, lambda index, parameters: torch.optim.AdamW(parameters, lr=rates[index]),
        folders,
    )  # fmt: skip
    actor, value_model = trained.models[0], trained.models[1] if critic else None
    optimizers = trained.optimizers

    throttle = Throttle(context.execution.checkpoint_seconds)
    initial = resume.epochs_done if resume else 0
    bar = stage_bar(total=ppo.epochs, initial=initial, desc=job.stage, unit="epoch", disable=not main)

    def save(folder: Path, progress: PPOProgress | None) -> None:
        """Actor, critic (if any), their optimizer states and (mid-stage) the progress and shuffling stream."""
        named = {"actor": actor} if value_model is None else {"actor": actor, "critic": value_model}
        steps = progress.optimizer_steps if progress else 0
        save_trained(
            trained, folder, named, dict(zip(OPTIMIZERS, optimizers, strict=False)), tokenizer=tokenizer, step=steps
        )
        if main and progress is not None:
            state = {"progress": progress._asdict(), "generator_state": generator.get_state().tolist(), "curve": curve}
            (folder / PROGRESS_FILE).write_text(json.dumps(state))

    def save_epoch(progress: PPOProgress) -> None:
        bar.update(1)
        due = main and progress.epochs_done < ppo.epochs and throttle.due()
        save_checkpoint(
            trained, out.final_dir, progress.epochs_done, due=due, write=lambda folder: save(folder, progress)
        )

    def record_step(step: int, stats: MinibatchStats) -> None:
        curve.append(
            {"step": step, **{name: float(value) for name, value in stats._asdict().items() if value is not None}}
        )

    experience = table_to_experience(
        read_table(settings.scored.directory, "scored_experience"), pad_token_id=tokenizer.pad_token_id
    )
    experience, off_policy = with_proximal_logprobs(
        settings, experience, actor, out.final_dir, resumed=checkpoint is not None, main=main
    )
    with bar:  # closed on an error too, so the error's line starts a line of its own
        stats = update(
            actor, value_model, optimizers[0], optimizers[1] if critic else None, experience, ppo,
            accelerator=accelerator, temperature=settings.temperature, norm_tokens=settings.max_new_tokens,
            generator=generator,
            resume=resume, on_epoch_end=save_epoch, on_step=record_step,
        )  # fmt: skip
    save(out.path, None)
    if main:
        write_training_curve(out.path, curve)
    return {
        **{name: float(value) for name, value in stats._asdict().items() if value is not None},
        "optimizer_restored": float(states is not None),
        **off_policy,
    }


ppo_update = Stage(PPOUpdateSettings, plan=plan, work=work, register={"actor": "actor", "critic": "critic"})
