"""The ``sft`` stage in one process, in 2 DDP processes and in 2 FSDP2 processes (issue 45): its per-step losses and its
weights against the one-process run's.

``.venv/bin/python -m bench.sft_processes [--demo-world DIR]``: one epoch of ``demo/sft.jsonl`` (6 steps of 8,
``sft.learning_rate`` 1e-3) on the demo's policy, each launch into a fresh ``bench/.scratch/sft-processes/<launch>``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from bench.common import REPO, SCRATCH
from campaign.config import load_config
from campaign.identity import demo_world_dir
from flows.iterations import context_for, resolve_base, tracking_store
from tasks.sft import sft

LAUNCHES = {
    "one process": (),
    "2 DDP processes": ("execution.training_processes=2",),
    "2 FSDP2 processes": (
        "execution.training_processes=2",
        f"execution.accelerate_config={REPO / 'configs' / 'accelerate' / 'fsdp.yaml'}",
    ),
}


def trained(name: str, world: Path | None, *more: str) -> Path:
    """The output folder of the ``sft`` stage under the launch ``more``."""
    root = SCRATCH / "sft-processes" / name.replace(" ", "-")
    shutil.rmtree(root, ignore_errors=True)
    overrides = [
        f"run_root={root}", "campaign=sft-processes", f"sft.data={REPO / 'demo' / 'sft.jsonl'}",
        "sft.learning_rate=1e-3", "sft.epochs=1", "execution.torch_threads=1", *more,
    ]  # fmt: skip
    config = load_config(REPO / "configs" / "demo.yaml", overrides)
    if world is not None:
        shutil.copytree(world, demo_world_dir(config))
    base = resolve_base.fn(config)
    tracker = tracking_store(config).tracker()
    return sft.run(context_for(config, 0, base, tracker.experiment_id(config.campaign)), config).directory


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sft_processes")
    parser.add_argument("--demo-world", type=Path, default=None)
    args = parser.parse_args()
    folders = {name: trained(name, args.demo_world, *more) for name, more in LAUNCHES.items()}
    one = folders["one process"]
    weights = load_file(one / "actor" / "model.safetensors")
    losses = [row["loss"] for row in json.loads((one / "training_curve.json").read_text())]
    print("| launch | largest step-loss difference | largest weight difference |\n| --- | ---: | ---: |")
    for name, folder in folders.items():
        other = load_file(folder / "actor" / "model.safetensors")
        curve = [row["loss"] for row in json.loads((folder / "training_curve.json").read_text())]
        loss_gap = max(abs(a - b) for a, b in zip(losses, curve, strict=True))
        weight_gap = max((weights[key].float() - other[key].float()).abs().max().item() for key in weights)
        print(f"| {name} | {loss_gap:.1e} | {weight_gap:.1e} |")


if __name__ == "__main__":
    main()
