"""The DPO update (``update: dpo``): a new actor trained on the iteration's pairs against the reference's stored
log-probs (:mod:`tasks.reference_logprobs`); no reward model, rollout, advantages or critic.

Like the PPO update (:mod:`tasks.ppo_update`) it starts from the previous policy's actor, saves its progress after an
epoch at most every ``checkpoint_seconds`` through the same checkpointer (:mod:`runtime.checkpointer`: a crashed run
continues from the last saved epoch and ends where an uninterrupted one would), and trains in this process or in
``execution.training_processes`` launched ones. Its optimizer starts fresh in every iteration and is not kept (TRL's
iterative DPO makes a new trainer per round), so the output holds the actor alone, with each pair's log-probs and
implicit rewards under it (``pair_measures``, what ``rlhf inspect`` shows). Its metrics are TRL ``DPOTrainer``'s, by
its names (:func:`rlhf_core.dpo.dpo_update`).
"""

from __future__ import annotations

from functools import partial

import pyarrow as pa
import torch

from rlhf_core.dpo import DPOProgress, PreferencePairs
from rlhf_core.dpo import dpo_update as update
from rlhf_core.preference_losses import SequenceLogprob
from runtime.checkpointer import Checkpointer
from runtime.job import Job, Training
from runtime.models import accelerator_for
from runtime.stage import Stage
from storage.schemas import (
    CHOSEN,
    CHOSEN_IDS,
    PAIR_ID,
    PAIR_MEASURES,
    PROMPT_IDS,
    REF_LOGPROBS,
    REJECTED,
    REJECTED_IDS,
)
from storage.shards import read_table
from tasks.settings import DPOUpdateSettings
from tasks.tensors import preference_pairs
from tasks.text import load_tokenizer


def stored_pairs(table: pa.Table, *, pad_token_id: int) -> PreferencePairs:
    """The pairs of a ``reference_logprobs`` table, with the reference's log-probs it holds."""

    def column(name: str) -> list:
        return table.column(name).to_pylist()

    pairs = preference_pairs(column(PROMPT_IDS), column(CHOSEN_IDS), column(REJECTED_IDS), pad_token_id=pad_token_id)
    reference = [
        SequenceLogprob(
            torch.tensor(column(f"{REF_LOGPROBS}_{side}"), dtype=torch.float32),
            torch.tensor(column(f"{REF_LOGPROBS}_{side}_mean"), dtype=torch.float32),
        )
        for side in (CHOSEN, REJECTED)
    ]
    return pairs.with_reference(*reference)


def plan(job: Job[DPOUpdateSettings]) -> Training:
    """Train in this process, or in ``execution.training_processes`` launched ones."""
    return Training(job.settings.precision)


def work(job: Job[DPOUpdateSettings]) -> dict[str, float]:
    """The update itself, in each training process: the main process writes the actor and its checkpoints."""
    settings, context, out = job.settings, job.context, job.out
    config = settings.dpo
    models = job.models(settings.precision)
    accelerator = accelerator_for(models.device, models.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    generator = job.generator()
    checkpointer = Checkpointer(
        accelerator, context.execution, out.final_dir, generator=generator, epochs=config.epochs, name=job.stage
    )
    trained, optimizers = checkpointer.prepare(
        {"actor": models.load("actor", settings.policy.directory / "actor", trainable=True)},
        {"actor": partial(torch.optim.AdamW, lr=config.learning_rate, weight_decay=0.0)},  # TRL's weight decay 0
    )
    table = read_table(settings.pairs.directory, "reference_logprobs")
    pairs = stored_pairs(table, pad_token_id=tokenizer.pad_token_id)
    with checkpointer:
        stats = update(
            trained["actor"], optimizers["actor"], pairs, config, accelerator=accelerator, generator=generator,
            resume=checkpointer.resume(DPOProgress), on_epoch_end=checkpointer.end_epoch,
            on_step=checkpointer.record_step,
        )  # fmt: skip
    checkpointer.save_output(out.path, tokenizer=tokenizer)
    if checkpointer.main:  # each pair as the new policy sees it, for `rlhf inspect` (flows.inspection)
        measures = {f"{name}_{side}": getattr(stats.pairs, f"{name}_{side}").tolist()
                    for name in ("logps", "rewards") for side in (CHOSEN, REJECTED)}  # fmt: skip
        measured = pa.table({PAIR_ID: table.column(PAIR_ID), **measures}, schema=PAIR_MEASURES)
        out.write_table("pair_measures", measured, schema=PAIR_MEASURES)
    return {
        **stats.metrics,
        "train_loss": stats.train_loss,
        "optimizer_steps": float(stats.optimizer_steps),
        "skipped_steps": float(stats.skipped_steps),
        "pairs": float(len(pairs)),
    }


dpo_update = Stage(DPOUpdateSettings, plan=plan, work=work, register={"actor": "actor"})
