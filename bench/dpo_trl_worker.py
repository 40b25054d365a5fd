"""One TRL ``DPOTrainer`` run over the folder of :mod:`bench.dpo_trl`; run with ``bench/.venv-trl``'s python.

``bench/.venv-trl/bin/python -m bench.dpo_trl_worker --folder DIR [--precompute] --out result.json``

Imports only the standard library, torch, transformers, datasets and trl (this project is not installed in that
venv). Records wall and CPU seconds of ``train()`` (``update``), of its loop from ``on_train_begin`` to the last
optimizer step (``loop``), and with ``--precompute`` of the reference's pass over all pairs that the trainer makes
when it is built (``reference``); and every optimizer step's loss. The settings are :mod:`bench.dpo_trl`'s.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from bench.common import Clock, set_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_threads(1)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    transformers.logging.set_verbosity_error()
    work = json.loads((args.folder / "work.json").read_text())
    with (args.folder / "pairs.jsonl").open() as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    clock = Clock()
    last_step: list[float] = []

    class OurOrder(torch.utils.data.Sampler):
        """Each epoch ``torch.randperm(n)`` from one generator seeded once: ``rlhf_core.dpo.dpo_update``'s order."""

        def __init__(self, n: int) -> None:
            self.n, self.generator = n, torch.Generator().manual_seed(work["seed"])

        def __iter__(self):
            return iter(torch.randperm(self.n, generator=self.generator).tolist())

        def __len__(self) -> int:
            return self.n

    class Trainer(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return OurOrder(len(train_dataset if train_dataset is not None else self.train_dataset))

        def _precompute_ref_logps(self, dataset, name, batch_size):
            with clock.measure("reference"):
                return super()._precompute_ref_logps(dataset, name, batch_size)

    class Loop(TrainerCallback):
        def on_train_begin(self, *_, **__):
            self.start = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            last_step[:] = [time.perf_counter(), time.process_time()]

        def on_train_end(self, *_, **__):
            clock.add("loop", last_step[0] - self.start[0], last_step[1] - self.start[1])

    config = DPOConfig(
        output_dir=str(args.out.parent / "trl-output"),
        per_device_train_batch_size=work["batch_size"],
        precompute_ref_batch_size=work["batch_size"],
        gradient_accumulation_steps=1,
        num_train_epochs=work["epochs"],
        learning_rate=work["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=work["max_grad_norm"],
        beta=work["beta"],
        loss_type=["sigmoid"],
        precompute_ref_log_probs=args.precompute,
        bf16=False,
        use_cpu=True,
        seed=work["seed"],
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.folder / "model", dtype=torch.float32)
    # Precomputed, TRL runs the reference pass with the policy before training and keeps no second model.
    reference = None if args.precompute else AutoModelForCausalLM.from_pretrained(args.folder / "model")
    dataset = Dataset.from_dict({key: [row[key] for row in rows] for key in ("prompt", "chosen", "rejected")})
    trainer = Trainer(
        model=model,
        ref_model=reference,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.folder / "tokenizer"),
        callbacks=[Loop()],
    )
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    tokenized = trainer.train_dataset
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):  # TRL trains on exactly the ids we train on
        if tokenized[key] != [row[key] for row in rows]:
            raise SystemExit(f"TRL's {key} differ from the pairs' ids")
    with clock.measure("update"):
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "side": "trl-precomputed" if args.precompute else "trl",
        "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "optimizer_steps": trainer.state.global_step,
        "losses": losses,
        "phases": clock.to_json(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
