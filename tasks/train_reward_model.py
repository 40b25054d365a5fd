"""Stage 3, train the reward model on every preference pair collected so far.

Training saves its progress after an epoch, at most every ``checkpoint_seconds`` (model, optimizer,
the shuffling stream and the global RNG that drives dropout); a crashed run continues from the
last saved epoch.
"""

from __future__ import annotations

import pyarrow as pa
import torch
from tqdm.auto import tqdm

from rlhf_core.config import LoraConfig, RewardModelConfig
from rlhf_core.precision import Precision
from rlhf_core.reward_training import PreferenceBatch, RewardTrainingProgress, fit_reward_model
from storage.checkpoints import load_training_state, save_model, save_training_state
from storage.manifest import StageOutput
from storage.progress import clear_progress, latest_progress, save_progress
from storage.shards import read_table
from tasks.context import StageContext
from tasks.stage import StageResult, Throttle, stage, stage_models
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


@stage(STAGE, register={"reward-model": "reward_model"})
def train_reward_model(
    out: StageOutput,
    context: StageContext,
    preferences: tuple[StageResult, ...],
    previous: StageResult | None,
    *,
    reward_model: RewardModelConfig,
    precision: Precision,
    lora: LoraConfig | None,
) -> dict[str, float]:
    """Continue training the previous reward model (or a fresh head on the base policy) on all pairs."""
    config = reward_model
    models = stage_models(out, context, precision, lora=lora)
    accelerator = models.accelerator()
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    table = pa.concat_tables([read_table(result.directory, "preferences") for result in preferences])
    if table.num_rows < 4:
        raise ValueError(f"train_reward_model needs at least 4 preference pairs, got {table.num_rows}")
    generator = context.generator(STAGE)
    pairs = preference_batch(table, tokenizer, pad_token_id=tokenizer.pad_token_id)
    order = torch.randperm(len(pairs), generator=generator)
    held_out = max(1, int(len(pairs) * config.eval_fraction))
    torch.manual_seed(context.stage_seed(STAGE))
    source = previous.directory / "reward_model" if previous is not None else context.base.policy.path
    checkpoint, resume = latest_progress(out.final_dir), None
    if checkpoint is not None:
        source = checkpoint[1] / "reward_model"
    model = models.load("reward_model", source, trainable=True)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=config.learning_rate, weight_decay=config.weight_decay)
    if checkpoint is not None:
        saved = load_training_state(checkpoint[1] / "optimizer", optimizer=optimizer)["extra"]  # restores dropout RNG
        resume = RewardTrainingProgress(**saved["progress"])
        generator.set_state(torch.tensor(saved["generator_state"], dtype=torch.uint8))
    model, optimizer = accelerator.prepare(model, optimizer)

    throttle = Throttle(context.execution.checkpoint_seconds)
    bar = tqdm(total=config.epochs, initial=resume.epochs_done if resume else 0, desc=STAGE, unit="epoch")

    def save_epoch(progress: RewardTrainingProgress) -> None:
        bar.update(1)

        def write(folder):
            save_model(folder / "reward_model", accelerator.unwrap_model(model), tokenizer)
            extra = {"progress": progress._asdict(), "generator_state": generator.get_state().tolist()}
            save_training_state(folder / "optimizer", optimizer=optimizer, step=progress.optimizer_steps, extra=extra)

        if progress.epochs_done < config.epochs and throttle.due():
            save_progress(out.final_dir, progress.epochs_done, write)

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
    )
    bar.close()
    save_model(out.path / "reward_model", accelerator.unwrap_model(model), tokenizer)
    clear_progress(out.final_dir)
    return {**{k: float(v) for k, v in stats._asdict().items()}, "pairs": float(len(pairs))}
