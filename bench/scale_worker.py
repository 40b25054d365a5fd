"""One variant of the model-scale benchmark: two iterations of a small campaign on a GPT-2-shaped model of
about 85 M parameters (random init, the demo tokenizer and prompts), full fine-tuning or LoRA, fp32 or bf16.

``python -m bench.scale_worker --variant lora-bf16 --world DIR --out FILE`` writes JSON: seconds and peak
memory per stage (from the stage manifests), bytes on disk under the run root after the two iterations, and
the model's own bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "full-fp32": [],
    "full-bf16": ["precision=bf16"],
    "lora-fp32": ["model.lora.r=8"],
    "lora-bf16": ["model.lora.r=8", "precision=bf16"],
}
SMALL = [
    "iterations=2",
    "sizes.preference_prompts=16",
    "sizes.candidates_per_prompt=2",
    "sizes.rollout_prompts=16",
    "sizes.eval_prompts=8",
    "sampling.max_new_tokens=8",
    "sampling.batch_size=16",
    "reward_model.epochs=1",
    "reward_model.batch_size=8",
    "ppo.epochs=1",
    "ppo.minibatch_size=8",
    "execution.checkpoint_seconds=600",
]
STAGES = (
    "initialize",
    "sample_candidates",
    "collect_preferences",
    "train_reward_model",
    "rollout",
    "compute_advantages",
    "ppo_update",
    "evaluate",
)


def build_model(world: Path) -> Path:
    """A GPT-2 of 12 layers x 768 (about 85 M parameters) with the demo tokenizer, saved once under ``world``."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from demo.build import build_default_world
    from storage.tokenizers import load_tokenizer

    folder = world / "gpt2-85m"
    if (folder / "config.json").is_file():
        return folder
    demo = build_default_world(world / "demo-world", seed=0, progress=False)
    tokenizer = load_tokenizer(demo.model_dir)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=768,
        n_layer=12,
        n_head=12,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    staging = Path(tempfile.mkdtemp(dir=world))
    AutoModelForCausalLM.from_config(config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.rename(staging, folder)
    return folder


def _parameters(model: Path) -> int:
    """Parameters in the model's safetensors files (from their headers, nothing loaded)."""
    from math import prod

    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as tensors:
            total += sum(prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())  # noqa: SIM118
    return total


def _bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--world", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = build_model(args.world)
    demo = args.world / "demo-world"

    from campaign.config import load_config
    from flows.rlhf_pipeline import rlhf_campaign

    with tempfile.TemporaryDirectory(dir=args.world) as run_root:
        config = load_config(
            None,
            [
                f"run_root={run_root}",
                "demo=true",  # the demo world's prompts and its gold rubric as the labeler, on this bigger model
                "labeler=gold",
                f"model.policy={model}",
                f"data.prompts={demo / 'prompts.jsonl'}",
                f"data.eval_prompts={demo / 'eval_prompts.jsonl'}",
                "campaign=scale",
                *SMALL,
                *VARIANTS[args.variant],
            ],
        )
        started = time.perf_counter()
        rlhf_campaign(config)
        wall = time.perf_counter() - started
        stages: dict[str, dict[str, list[float]]] = {}
        for manifest_path in sorted(Path(run_root, "scale").glob("*/*/_manifest.json")):
            manifest = json.loads(manifest_path.read_text())
            row = stages.setdefault(manifest["stage"], {"seconds": [], "peak_memory_mb": []})
            row["seconds"].append(manifest["metrics"]["seconds"])
            row["peak_memory_mb"].append(manifest["metrics"]["peak_memory_mb"])
        result = {
            "variant": args.variant,
            "wall_seconds": wall,
            "parameters": _parameters(model),
            "model_bytes": _bytes(model),
            "disk_bytes": _bytes(Path(run_root)),
            "stages": stages,
        }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
