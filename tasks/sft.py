"""Supervised fine-tuning before iteration 0 (``sft.data``): the pretrained policy trained on demonstrations, with the
loss on the assistant's tokens only (:mod:`rlhf_core.sft`); its output is the campaign's initial policy, and so its
reference (:meth:`runtime.context.BaseInputs.supervised`).

The output holds the imported examples (``sft_examples``, Parquet: the rows the policy learned from, whatever file
they came from) and ``actor/``, a whole model: with LoRA (``model.lora``) its adapters are merged into the weights, so
the iterations start fresh adapters over it and their reference (the actor with its adapters off) is the SFT model.
Like the updates it trains in this process or in ``execution.training_processes`` launched ones (FSDP2 under
``execution.sharding``, full fine-tuning only), and saves its progress after an optimizer step at most every
``checkpoint_seconds`` through the checkpointer (:mod:`runtime.checkpointer`): a crashed run continues mid-epoch and
ends where an uninterrupted one would, to the byte. With ``sft.packing`` each minibatch's examples are packed several to a
row (:mod:`rlhf_core.packing`), after a check that the model's attention keeps them apart.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from rlhf_core.errors import UserError
from rlhf_core.packing import keeps_packed_examples_apart
from rlhf_core.sft import SFTExamples, SFTProgress, optimizer_steps, padding_share, sft_update
from runtime.checkpointer import Checkpointer
from runtime.job import Job, Training
from runtime.models import accelerator_for
from runtime.stage import Stage
from storage.importers import import_sft_examples
from storage.schemas import SFT_EXAMPLES
from storage.shards import write_shards
from tasks.settings import SFTSettings
from tasks.sft_text import nothing_to_learn, tokenize_examples
from tasks.text import load_tokenizer

TABLE = "sft_examples"


class NothingToLearn(UserError, ValueError):
    """An SFT example with no token for the model to learn (its assistant tokens cut to none)."""


class PackingUnsupported(UserError, ValueError):
    """``sft.packing`` with a model whose attention lets packed examples see each other."""


def plan(job: Job[SFTSettings]) -> Training:
    """Train in this process, or in ``execution.training_processes`` launched ones."""
    return Training(job.settings.precision)


def work(job: Job[SFTSettings]) -> dict[str, float]:
    """The fine-tuning itself, in each training process: the main process writes the examples and the actor."""
    settings, context, out = job.settings, job.context, job.out
    config = settings.sft
    models = job.models(settings.precision, lora=settings.lora)
    accelerator = accelerator_for(models.device, models.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    table = import_sft_examples(Path(settings.data.path))
    rows = tokenize_examples(tokenizer, table)
    if (empty := nothing_to_learn(rows)) is not None:
        raise NothingToLearn(f"`sft.data` {settings.data.path}, row {empty + 1}: no token for the model to learn")
    examples = SFTExamples.of(rows, pad_token_id=tokenizer.pad_token_id)
    checkpointer = Checkpointer(
        accelerator, context.execution, out.final_dir, generator=job.generator(),
        epochs=optimizer_steps(len(examples), config), name=job.stage, unit="step",
    )  # fmt: skip
    torch.manual_seed(job.seed())  # fresh adapters
    actor = models.load("actor", context.base.policy.path, trainable=True)
    if config.packing and not keeps_packed_examples_apart(actor):
        model_class = type(actor.get_base_model() if hasattr(actor, "get_base_model") else actor).__name__  # LoRA's
        raise PackingUnsupported(
            f"`sft.packing` with {model_class} ({context.base.policy.path}): its attention lets packed examples see "
            "each other (it builds its mask without the position ids); set `sft.packing` false"
        )
    trained, optimizers = checkpointer.prepare(
        {"actor": actor},
        {"actor": partial(torch.optim.AdamW, lr=config.learning_rate, weight_decay=0.0)},  # TRL's weight decay 0
    )
    with checkpointer:
        stats = sft_update(
            trained["actor"], optimizers["actor"], examples, config, accelerator=accelerator, seed=job.seed(),
            resume=checkpointer.resume(SFTProgress), on_step_end=checkpointer.end_step,
            on_step=checkpointer.record_step,
        )  # fmt: skip
    if accelerator.is_main_process:
        write_shards(out.path, TABLE, table, schema=SFT_EXAMPLES, rows_per_shard=settings.rows_per_shard)
    checkpointer.save_output(out.path, tokenizer=tokenizer, whole=True)
    return {
        "train_loss": stats.train_loss,
        "optimizer_steps": float(stats.optimizer_steps),
        "skipped_steps": float(stats.skipped_steps),
        "examples": float(len(examples)),
        "assistant_tokens": float(examples.loss_mask[:, 1:].sum()),
        "padding_share": padding_share(examples, config, seed=job.seed(), world=accelerator.num_processes),
    }


sft = Stage(SFTSettings, plan=plan, work=work)
