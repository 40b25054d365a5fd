"""Stage 3, train the reward model on every preference pair collected so far.

It continues the previous iteration's reward model, or starts from a pretrained one
(``model.reward_model``) or from the policy's backbone with a fresh head. With
``reward_model.train`` false it takes the pretrained one as it is: its output then refers to it
(nothing is copied) and carries no held-out statistics.

Pairs are rendered as conversations in the reward model's own tokens (:func:`tasks.text.conversation_id_lists`).
The pairs held out for its accuracy and score statistics are split off each iteration's table alike in every
iteration (:func:`rlhf_core.reward_training.arrival_split`): they accumulate, and none is ever trained on. A table
of pairs asked about by ``asking.select`` holds out the rows it drew at random for it
(:func:`tasks.pairing.held_out_head`). With ``reward_model.replay_ratio`` it trains on this iteration's pairs (every
round's: :func:`first_new_table`) and a replay of older ones (:func:`rlhf_core.reward_training.replayed_rows`).
Training saves its progress after an epoch, at most every ``checkpoint_seconds`` (model, optimizer and
the shuffling stream; dropout masks are seeded per epoch and process, so they need no saved state); a
crashed run continues from the last saved epoch. With ``execution.training_processes`` N > 1 it trains in N
``accelerate launch`` processes, each on its share of every minibatch (:mod:`runtime.launch`,
:mod:`rlhf_core.distributed`), the model sharded over them under FSDP2 (:mod:`runtime.checkpointer`); the main
process writes the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import pyarrow as pa
import torch

from rlhf_core.config import eval_split_error
from rlhf_core.errors import UserError
from rlhf_core.reward_training import (
    PreferenceBatch,
    RewardTrainingProgress,
    arrival_split,
    fit_reward_model,
    replayed_rows,
)
from runtime.checkpointer import Checkpointer
from runtime.declaration import StageResult
from runtime.job import Job, Training
from runtime.models import accelerator_for
from runtime.stage import Stage
from storage.checkpoints import save_model
from storage.manifest import read_manifest
from storage.shards import read_table
from tasks.pairing import held_out_head
from tasks.settings import TrainRewardModelSettings
from tasks.tensors import pad_token_lists
from tasks.text import conversation_id_lists, load_tokenizer, prompts_of


class TooFewPairs(UserError, ValueError):
    """The preference pairs cannot train a reward model whose accuracy means something (too few to hold out)."""


def preference_batch(table: pa.Table, tokenizer) -> PreferenceBatch:
    """The conversations ``prompt + chosen`` and ``prompt + rejected`` in ``tokenizer``'s ids, padded to one width."""
    prompts = prompts_of(table)
    responses = table.column("chosen").to_pylist() + table.column("rejected").to_pylist()
    rows = conversation_id_lists(tokenizer, prompts + prompts, responses)
    ids, mask = pad_token_lists(rows, pad_token_id=tokenizer.pad_token_id)  # (2B, T)
    margin = torch.tensor(table.column("margin").to_pylist(), dtype=torch.float32)
    return PreferenceBatch(ids[: len(prompts)], mask[: len(prompts)], ids[len(prompts) :], mask[len(prompts) :], margin)


def table_seed(preferences: StageResult) -> int:
    """The seed a preference table's rows are ordered by for the held-out split: from its digest, so the same table
    splits alike in every iteration that trains on it (:func:`rlhf_core.reward_training.arrival_split`)."""
    return int(preferences.digest[:16], 16)


def first_new_table(preferences: Sequence[StageResult], previous: StageResult) -> int:
    """The index of the first of ``preferences`` that the ``previous`` reward model was not trained on: the tables
    before it are the ones its manifest names upstream (``preferences_*``), the rest this iteration's, one a round of
    candidates (``sizes.decisive_pairs``), so several.

    Raises:
        ValueError: a table the previous reward model was trained on follows one it was not.
    """
    upstream = read_manifest(previous.directory, verify=False).upstream
    seen = {digest for name, digest in upstream.items() if name.startswith("preferences_")}
    known = [result.digest in seen for result in preferences]
    first = known.index(False) if False in known else len(known)
    if any(known[first:]):
        raise ValueError("the preference tables are not the previous reward model's followed by this iteration's")
    return first


def plan(job: Job[TrainRewardModelSettings]) -> Training | None:
    """Take a pretrained reward model as it is (``reward_model.train`` false: here, :func:`refer_to_pretrained`), or
    refuse too few pairs before any training process starts; then train in this process, or in
    ``execution.training_processes`` launched ones."""
    settings = job.settings
    if not settings.reward_model.train:
        return None
    pairs = sum(read_manifest(result.directory, verify=False).rows("preferences") for result in settings.preferences)
    if (error := eval_split_error(pairs, settings.reward_model.eval_fraction)) is not None:  # checked before it all
        raise TooFewPairs(  # ran, except where tie/skip answers left out pairs
            f"train_reward_model: {error}. `sizes.decisive_pairs` samples rounds of fresh prompts (with human labels, "
            "pages of them) until there are enough; with human labels, fewer `tie/skip` answers do it too: run the "
            "same command with a new `human.relabel` value to be asked again"
        )
    return Training(settings.precision)


def work(job: Job[TrainRewardModelSettings]) -> dict[str, float]:
    """Train the reward model, in each training process (the main process writes the output and its checkpoints);
    with ``reward_model.train`` false, refer to the pretrained one instead (:func:`refer_to_pretrained`)."""
    settings, context, out = job.settings, job.context, job.out
    if not settings.reward_model.train:
        return refer_to_pretrained(job)
    config, previous = settings.reward_model, settings.previous
    models = job.models(settings.precision, lora=settings.lora)
    tokenizer = load_tokenizer(context.base.reward_tokenizer)
    pretrained = context.base.reward_model.path if context.base.reward_model else None
    accelerator = accelerator_for(models.device, models.precision)
    tables = [read_table(result.directory, "preferences") for result in settings.preferences]
    generator = job.generator()
    pairs = preference_batch(pa.concat_tables(tables), tokenizer)
    sizes = [table.num_rows for table in tables]
    train, held_out = arrival_split(
        sizes,
        [table_seed(result) for result in settings.preferences],
        config.eval_fraction,
        held_out_heads=[held_out_head(result) for result in settings.preferences],
    )
    if config.replay_ratio is not None and previous is not None:  # continues: new pairs, and a replay of older ones
        new_from = sum(sizes[: first_new_table(settings.preferences, previous)])
        train = replayed_rows(train, new_from=new_from, ratio=config.replay_ratio, generator=generator)
    torch.manual_seed(job.seed())  # a fresh reward head is drawn from the global RNG
    source = previous.directory / "reward_model" if previous is not None else pretrained or context.base.policy.path
    checkpointer = Checkpointer(
        accelerator, context.execution, out.final_dir, generator=generator, epochs=config.epochs, name=job.stage
    )
    trained, optimizers = checkpointer.prepare(
        {"reward_model": models.load("reward_model", source, trainable=True)},
        {"reward_model": partial(torch.optim.AdamW, lr=config.learning_rate, weight_decay=config.weight_decay)},
    )
    with checkpointer:
        stats = fit_reward_model(
            trained["reward_model"],
            optimizers["reward_model"],
            pairs.select(train),
            pairs.select(held_out),
            config,
            accelerator=accelerator,
            generator=generator,
            resume=checkpointer.resume(RewardTrainingProgress),
            on_epoch_end=checkpointer.end_epoch,
            on_step=checkpointer.record_step,
            dropout_seed=job.seed(),
        )
    checkpointer.save_output(out.path, tokenizer=tokenizer)
    # eval_accuracy rests on eval_pairs pairs: with few (a sparse first iteration), it moves in large steps until
    # later iterations add theirs.
    metrics = {k: float(v) for k, v in stats._asdict().items()}
    return {**metrics, "pairs": float(len(pairs)), "train_pairs": float(len(train)), "eval_pairs": float(len(held_out))}


def refer_to_pretrained(job: Job[TrainRewardModelSettings]) -> dict[str, float]:
    """The output of a reward model taken as it is: a folder that refers to the pretrained ``model.reward_model``
    (nothing is copied), with no held-out statistics."""
    base = job.context.base
    if base.reward_model is None:
        raise ValueError("`reward_model.train` false needs `model.reward_model`: the pretrained reward model to use")
    models = job.models(job.settings.precision)
    tokenizer = load_tokenizer(base.reward_tokenizer)
    save_model(
        job.out.path / "reward_model", models.load("reward_model", base.reward_model.path), tokenizer, weights=False
    )
    return {"pairs": 0.0}


train_reward_model = Stage(TrainRewardModelSettings, plan=plan, work=work, register={"reward-model": "reward_model"})
