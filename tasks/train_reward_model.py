"""Stage 3, train the reward model on every preference pair collected so far.

It continues the previous iteration's reward model, or starts from a pretrained one
(``model.reward_model``) or from the policy's backbone with a fresh head. With
``reward_model.train`` false it takes the pretrained one as it is: its output then refers to it
(nothing is copied) and carries no held-out statistics.

Pairs are rendered as conversations in the reward model's own tokens (:func:`tasks.text.conversation_id_lists`).
Training saves its progress after an epoch, at most every ``checkpoint_seconds`` (model, optimizer and
the shuffling stream; dropout masks are seeded per epoch and process, so they need no saved state); a
crashed run continues from the last saved epoch. With ``execution.training_processes`` N > 1 it trains in N
``accelerate launch`` processes, each on its share of every minibatch (:mod:`runtime.launch`,
:mod:`rlhf_core.distributed`), the model sharded over them under FSDP2 (:mod:`runtime.training`); the main
process writes the model.
"""

from __future__ import annotations

import pyarrow as pa
import torch

from rlhf_core.config import eval_split_error, held_out_pairs
from rlhf_core.errors import UserError
from rlhf_core.reward_training import PreferenceBatch, RewardTrainingProgress, fit_reward_model
from runtime.bars import stage_bar
from runtime.job import Job, Training
from runtime.metering import Throttle
from runtime.models import accelerator_for
from runtime.record import write_training_curve
from runtime.stage import Stage
from runtime.training import check_states, save_checkpoint, save_trained, train_models
from storage.checkpoints import save_model
from storage.manifest import read_manifest
from storage.progress import latest_progress
from storage.shards import read_table
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


def plan(job: Job[TrainRewardModelSettings]) -> Training | None:
    """Take a pretrained reward model as it is (``reward_model.train`` false: here, :func:`refer_to_pretrained`), or
    refuse too few pairs before any training process starts; then train in this process, or in
    ``execution.training_processes`` launched ones."""
    settings, context = job.settings, job.context
    if not settings.reward_model.train:
        return None
    pairs = sum(
        entry.rows or 0
        for result in settings.preferences
        for entry in read_manifest(result.directory, verify=False).files
        if entry.path.startswith("preferences-")
    )
    if (error := eval_split_error(pairs, settings.reward_model.eval_fraction)) is not None:  # checked before it all
        raise TooFewPairs(  # ran, except where tie/skip answers left out pairs
            f"train_reward_model: {error}. With human labels, fewer `tie/skip` answers do it: run the same command "
            "with a new `human.relabel` value to be asked again"
        )
    if (checkpoint := latest_progress(job.out.final_dir)) is not None:  # a crashed attempt's, which training continues
        check_states(context.execution, [checkpoint[1] / "optimizer"])
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
    main = accelerator.is_main_process
    table = pa.concat_tables([read_table(result.directory, "preferences") for result in settings.preferences])
    generator = job.generator()
    pairs = preference_batch(table, tokenizer)
    order = torch.randperm(len(pairs), generator=generator)
    held_out = held_out_pairs(len(pairs), config.eval_fraction)
    torch.manual_seed(job.seed())  # a fresh reward head is drawn from the global RNG
    source = previous.directory / "reward_model" if previous is not None else pretrained or context.base.policy.path
    checkpoint, resume = latest_progress(out.final_dir), None
    if checkpoint is not None:
        source = checkpoint[1] / "reward_model"
    trained, (restored,) = train_models(
        accelerator, context.execution, [models.load("reward_model", source, trainable=True)],
        lambda _, parameters: torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay),
        [None if checkpoint is None else checkpoint[1] / "optimizer"],
    )  # fmt: skip
    (model,), (optimizer,) = trained.models, trained.optimizers
    curve: list[dict[str, float]] = []
    if checkpoint is not None:
        saved = restored["extra"]
        resume = RewardTrainingProgress(**saved["progress"])
        generator.set_state(torch.tensor(saved["generator_state"], dtype=torch.uint8))
        curve = saved["curve"]

    throttle = Throttle(context.execution.checkpoint_seconds)
    initial = resume.epochs_done if resume else 0
    bar = stage_bar(total=config.epochs, initial=initial, desc=job.stage, unit="epoch", disable=not main)

    def save_epoch(progress: RewardTrainingProgress) -> None:
        bar.update(1)

        def write(folder):
            extra = {"progress": progress._asdict(), "generator_state": generator.get_state().tolist(), "curve": curve}
            save_trained(
                trained, folder, {"reward_model": model}, {"optimizer": optimizer}, tokenizer=tokenizer,
                step=progress.optimizer_steps, extra=extra,
            )  # fmt: skip

        due = main and progress.epochs_done < config.epochs and throttle.due()
        save_checkpoint(trained, out.final_dir, progress.epochs_done, due=due, write=write)

    with bar:  # closed on an error too, so the error's line starts a line of its own
        stats = fit_reward_model(
            model,
            optimizer,
            pairs.select(order[held_out:]),
            pairs.select(order[:held_out]),
            config,
            accelerator=accelerator,
            generator=generator,
            resume=resume,
            on_epoch_end=save_epoch,
            on_step=lambda step, values: curve.append({"step": step, **values}),
            dropout_seed=job.seed(),
        )
    save_trained(trained, out.path, {"reward_model": model}, {}, tokenizer=tokenizer, step=0)
    if main:
        write_training_curve(out.path, curve)
    # eval_accuracy rests on eval_pairs pairs: with few, it moves in large steps (1 pair: 0 or 1).
    metrics = {k: float(v) for k, v in stats._asdict().items()}
    return {**metrics, "pairs": float(len(pairs)), "eval_pairs": float(held_out)}


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
