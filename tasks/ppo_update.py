"""Stage 6, PPO update: new actor and critic checkpoints from the scored experience.

With a critic-free estimator (``critic`` False) the actor alone is loaded, trained and saved: the
new policy has no ``critic/``, and neither have the policies after it.

The update saves its progress after an epoch, at most every ``checkpoint_seconds`` (models,
optimizers, the shuffling stream and running statistics); a crashed run continues from the last
saved epoch and ends exactly where an uninterrupted one would.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rlhf_core.config import PPOConfig
from rlhf_core.ppo import PPOProgress
from rlhf_core.ppo import ppo_update as update
from rlhf_core.precision import Precision
from storage.checkpoints import load_training_state, save_model, save_training_state
from storage.experience_io import table_to_experience
from storage.manifest import StageOutput
from storage.progress import clear_progress, latest_progress, save_progress
from storage.shards import read_table
from tasks.context import StageContext
from tasks.stage import StageResult, Throttle, stage, stage_models
from tasks.text import load_tokenizer

STAGE = "ppo_update"
PROGRESS_FILE = "progress.json"
OPTIMIZERS = ("actor_optimizer", "critic_optimizer")


def _save_state(
    folder: Path, actor, critic, optimizers, generator: torch.Generator, progress: PPOProgress | None, tokenizer
) -> None:
    """Actor, critic (if any), their optimizer states and (mid-stage) the progress and shuffling stream."""
    save_model(folder / "actor", actor, tokenizer)
    if critic is not None:
        save_model(folder / "critic", critic, tokenizer)
    for name, optimizer in zip(OPTIMIZERS, optimizers, strict=False):
        save_training_state(
            folder / name, optimizer=optimizer, step=progress.optimizer_steps if progress else 0, rng=False
        )
    if progress is not None:
        state = {"progress": progress._asdict(), "generator_state": generator.get_state().tolist()}
        (folder / PROGRESS_FILE).write_text(json.dumps(state))


@stage(STAGE, register={"actor": "actor", "critic": "critic"})
def ppo_update(
    out: StageOutput,
    context: StageContext,
    policy: StageResult,
    scored: StageResult,
    *,
    ppo: PPOConfig,
    critic: bool,
    precision: Precision,
    temperature: float,
    max_new_tokens: int,
) -> dict[str, float]:
    """Write ``actor/`` (and ``critic/``) and their optimizer states after PPO epochs over the experience.

    Args:
        critic: train the policy's critic (GAE), or update the actor alone (critic-free estimators).
        temperature: the sampling temperature of the rollout (the update's log-probs use it too).
        max_new_tokens: the generation budget, the constant of the ``token_sum_norm`` aggregation.
    """
    if critic and not (policy.directory / "critic").is_dir():
        raise ValueError(
            f"advantages.estimator gae trains a critic, but the policy in {policy.directory} has none (it was "
            "trained by a critic-free estimator): keep a critic-free estimator, or start a new campaign"
        )
    models = stage_models(out, context, precision)
    accelerator = models.accelerator()
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    generator = context.generator(STAGE)
    checkpoint = latest_progress(out.final_dir)
    source, resume = policy.directory, None
    if checkpoint is not None:
        source = checkpoint[1]
        saved = json.loads((source / PROGRESS_FILE).read_text())
        resume = PPOProgress(**saved["progress"])
        generator.set_state(torch.tensor(saved["generator_state"], dtype=torch.uint8))
    actor = models.load("actor", source / "actor", trainable=True)
    trained = [(actor, ppo.actor_learning_rate)]
    if critic:
        trained.append((models.load("critic", source / "critic", trainable=True), ppo.critic_learning_rate))
    optimizers = [torch.optim.AdamW(model.parameters(), lr=rate) for model, rate in trained]
    # A critic-free policy (or one that continues critic-free from a GAE one) has no critic optimizer to restore.
    for name, optimizer in zip(OPTIMIZERS, optimizers, strict=False):
        if (source / name).is_dir():
            load_training_state(source / name, optimizer=optimizer)
    actor, *rest = accelerator.prepare(*(model for model, _ in trained), *optimizers)
    value_model = rest.pop(0) if critic else None
    optimizers = rest

    throttle = Throttle(context.execution.checkpoint_seconds)
    bar = tqdm(total=ppo.epochs, initial=resume.epochs_done if resume else 0, desc=STAGE, unit="epoch")

    def save(folder: Path, progress: PPOProgress | None) -> None:
        unwrap = accelerator.unwrap_model
        critic_model = None if value_model is None else unwrap(value_model)
        _save_state(folder, unwrap(actor), critic_model, optimizers, generator, progress, tokenizer)

    def save_epoch(progress: PPOProgress) -> None:
        bar.update(1)
        if progress.epochs_done < ppo.epochs and throttle.due():
            save_progress(out.final_dir, progress.epochs_done, lambda folder: save(folder, progress))

    experience = table_to_experience(
        read_table(scored.directory, "scored_experience"), pad_token_id=tokenizer.pad_token_id
    )
    stats = update(
        actor, value_model, optimizers[0], optimizers[1] if critic else None, experience, ppo,
        accelerator=accelerator, temperature=temperature, norm_tokens=max_new_tokens, generator=generator,
        resume=resume, on_epoch_end=save_epoch,
    )  # fmt: skip
    bar.close()
    save(out.path, None)
    clear_progress(out.final_dir)
    return {name: float(value) for name, value in stats._asdict().items() if value is not None}
