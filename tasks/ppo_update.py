"""Stage 6, PPO update: new actor and critic checkpoints from the scored experience.

The update saves its progress after an epoch, at most every ``checkpoint_seconds`` (models, optimizers, the shuffling stream and
running statistics); a crashed run continues from the last saved epoch and ends exactly where an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State
from tqdm.auto import tqdm

from rlhf_core.ppo import PPOProgress
from rlhf_core.ppo import ppo_update as update
from storage.checkpoints import load_causal_lm, load_critic, load_training_state, save_model, save_training_state
from storage.experience_io import table_to_experience
from storage.manifest import StageOutput
from storage.progress import clear_progress, latest_progress, save_progress
from storage.shards import read_table
from tasks.runtime import IterationContext, StageResult, Throttle, accelerator_for, run_stage, stage_state
from tasks.text import load_tokenizer

STAGE = "ppo_update"
PROGRESS_FILE = "progress.json"


def _save_state(
    folder: Path, actor, critic, optimizers, generator: torch.Generator, progress: PPOProgress | None, tokenizer
) -> None:
    """Actor, critic, both optimizer states and (mid-stage) the progress and shuffling stream."""
    save_model(folder / "actor", actor, tokenizer)
    save_model(folder / "critic", critic, tokenizer)
    for name, optimizer in zip(("actor_optimizer", "critic_optimizer"), optimizers, strict=True):
        save_training_state(
            folder / name, optimizer=optimizer, step=progress.optimizer_steps if progress else 0, rng=False
        )
    if progress is not None:
        state = {"progress": progress._asdict(), "generator_state": generator.get_state().tolist()}
        (folder / PROGRESS_FILE).write_text(json.dumps(state))


@task(name=STAGE, cache_policy=NO_CACHE)
def ppo_update(context: IterationContext, policy: StageResult, scored: StageResult) -> State:
    """Write ``actor/``, ``critic/`` and their optimizer states after PPO epochs over the experience."""
    config = context.config

    def produce(out: StageOutput) -> dict[str, float]:
        accelerator = accelerator_for(config)
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        generator = context.generator(STAGE)
        checkpoint = latest_progress(out.final_dir)
        source, resume = policy.directory, None
        if checkpoint is not None:
            source = checkpoint[1]
            saved = json.loads((source / PROGRESS_FILE).read_text())
            resume = PPOProgress(
                saved["progress"]["epochs_done"],
                tuple(saved["progress"]["totals"]),
                saved["progress"]["optimizer_steps"],
            )
            generator.set_state(torch.tensor(saved["generator_state"], dtype=torch.uint8))
        actor, critic = load_causal_lm(source / "actor"), load_critic(source / "critic")
        optimizers = (
            torch.optim.AdamW(actor.parameters(), lr=config.ppo.actor_learning_rate),
            torch.optim.AdamW(critic.parameters(), lr=config.ppo.critic_learning_rate),
        )
        if (source / "actor_optimizer").is_dir():
            for name, optimizer in zip(("actor_optimizer", "critic_optimizer"), optimizers, strict=True):
                load_training_state(source / name, optimizer=optimizer)
        actor, critic, *optimizers = accelerator.prepare(actor, critic, *optimizers)

        throttle = Throttle(config.checkpoint_seconds)
        bar = tqdm(total=config.ppo.epochs, initial=resume.epochs_done if resume else 0, desc=STAGE, unit="epoch")

        def save_epoch(progress: PPOProgress) -> None:
            bar.update(1)
            if progress.epochs_done < config.ppo.epochs and throttle.due():
                unwrap = accelerator.unwrap_model
                save_progress(
                    out.final_dir,
                    progress.epochs_done,
                    lambda folder: _save_state(
                        folder, unwrap(actor), unwrap(critic), optimizers, generator, progress, tokenizer
                    ),
                )

        experience = table_to_experience(
            read_table(scored.directory, "scored_experience"), pad_token_id=tokenizer.pad_token_id
        )
        stats = update(
            actor, critic, *optimizers, experience, config.ppo,
            accelerator=accelerator, temperature=config.sampling.temperature, generator=generator,
            resume=resume, on_epoch_end=save_epoch,
        )  # fmt: skip
        _save_state(
            out.path,
            accelerator.unwrap_model(actor),
            accelerator.unwrap_model(critic),
            optimizers,
            generator,
            None,
            tokenizer,
        )
        clear_progress(out.final_dir)
        return {name: float(value) for name, value in stats._asdict().items()}

    slice_ = {
        "ppo": dataclasses.asdict(config.ppo),
        "temperature": config.sampling.temperature,
        "seed": config.seed,
        "iteration": context.iteration,
    }
    return stage_state(
        run_stage(
            context,
            STAGE,
            config=slice_,
            upstream={"policy": policy, "scored": scored},
            produce=produce,
            register={"actor": "actor", "critic": "critic"},
        )
    )
