"""Stage 3, train the reward model on every preference pair collected so far.

Training saves its progress after an epoch, at most every ``checkpoint_seconds`` (model, optimizer, the shuffling stream and the
global RNG that drives dropout); a crashed run continues from the last saved epoch.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State
from tqdm.auto import tqdm

from rlhf_core.models import RewardModel
from rlhf_core.reward_training import PreferenceBatch, RewardTrainingProgress, fit_reward_model
from storage.checkpoints import load_training_state, save_model, save_training_state
from storage.manifest import StageOutput
from storage.progress import clear_progress, latest_progress, save_progress
from storage.shards import read_table
from tasks.runtime import IterationContext, StageResult, Throttle, accelerator_for, run_stage, stage_state
from tasks.text import encode_response, load_tokenizer, pad_token_lists

STAGE = "train_reward_model"


def preference_batch(table: pa.Table, tokenizer, *, pad_token_id: int) -> PreferenceBatch:
    """Tokenise ``prompt + chosen`` and ``prompt + rejected`` to one padded width."""
    rows = table.to_pylist()
    chosen = [encode_response(tokenizer, row["prompt"], row["chosen"]) for row in rows]
    rejected = [encode_response(tokenizer, row["prompt"], row["rejected"]) for row in rows]
    ids, mask = pad_token_lists(chosen + rejected, pad_token_id=pad_token_id)  # (2B, T)
    margin = torch.tensor([row["margin"] for row in rows], dtype=torch.float32)
    return PreferenceBatch(ids[: len(rows)], mask[: len(rows)], ids[len(rows) :], mask[len(rows) :], margin)


@task(name=STAGE, cache_policy=NO_CACHE)
def train_reward_model(
    context: IterationContext, preferences: tuple[StageResult, ...], previous: StageResult | None
) -> State:
    """Continue training the previous reward model (or a fresh head on the base policy) on all pairs."""
    config = context.config

    def produce(out: StageOutput) -> dict[str, float]:
        accelerator = accelerator_for(config)
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        table = pa.concat_tables([read_table(result.directory, "preferences") for result in preferences])
        if table.num_rows < 4:
            raise ValueError(f"train_reward_model needs at least 4 preference pairs, got {table.num_rows}")
        generator = context.generator(STAGE)
        pairs = preference_batch(table, tokenizer, pad_token_id=tokenizer.pad_token_id)
        order = torch.randperm(len(pairs), generator=generator)
        held_out = max(1, int(len(pairs) * config.reward_model.eval_fraction))
        torch.manual_seed(context.seed(STAGE))
        source = previous.directory / "reward_model" if previous is not None else context.base.policy_dir
        checkpoint, resume = latest_progress(out.final_dir), None
        if checkpoint is not None:
            source = checkpoint[1] / "reward_model"
        model = RewardModel.from_pretrained(source)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.reward_model.learning_rate, weight_decay=config.reward_model.weight_decay
        )
        if checkpoint is not None:
            saved = load_training_state(checkpoint[1] / "optimizer", optimizer=optimizer)[
                "extra"
            ]  # restores dropout RNG
            resume = RewardTrainingProgress(**saved["progress"])
            generator.set_state(torch.tensor(saved["generator_state"], dtype=torch.uint8))
        model, optimizer = accelerator.prepare(model, optimizer)

        throttle = Throttle(config.checkpoint_seconds)
        bar = tqdm(
            total=config.reward_model.epochs, initial=resume.epochs_done if resume else 0, desc=STAGE, unit="epoch"
        )

        def save_epoch(progress: RewardTrainingProgress) -> None:
            bar.update(1)

            def write(folder):
                save_model(folder / "reward_model", accelerator.unwrap_model(model), tokenizer)
                extra = {"progress": progress._asdict(), "generator_state": generator.get_state().tolist()}
                save_training_state(
                    folder / "optimizer", optimizer=optimizer, step=progress.optimizer_steps, extra=extra
                )

            if progress.epochs_done < config.reward_model.epochs and throttle.due():
                save_progress(out.final_dir, progress.epochs_done, write)

        stats = fit_reward_model(
            model,
            optimizer,
            pairs.select(order[held_out:]),
            pairs.select(order[:held_out]),
            config.reward_model,
            accelerator=accelerator,
            generator=generator,
            resume=resume,
            on_epoch_end=save_epoch,
        )
        bar.close()
        save_model(out.path / "reward_model", accelerator.unwrap_model(model), tokenizer)
        clear_progress(out.final_dir)
        return {**{k: float(v) for k, v in stats._asdict().items()}, "pairs": float(len(pairs))}

    upstream = {f"preferences_{index}": result for index, result in enumerate(preferences)}
    upstream["previous"] = previous
    slice_ = {
        "reward_model": dataclasses.asdict(config.reward_model),
        "seed": config.seed,
        "iteration": context.iteration,
    }
    return stage_state(
        run_stage(
            context, STAGE, config=slice_, upstream=upstream, produce=produce, register={"reward-model": "reward_model"}
        )
    )
