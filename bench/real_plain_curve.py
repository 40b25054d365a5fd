"""The learning curve of ``configs/smollm2.yaml`` as a plain loop of ``rlhf_core`` calls, on any device.

``python -m bench.real_plain_curve --gguf FILE --device cuda --iterations 8 --out FILE``

Imports only torch, transformers, accelerate, peft, gguf and ``rlhf_core`` (no Prefect, MLflow, Parquet), so it
runs where the product's other dependencies are not installed: a GPU machine, to check what the example's
settings learn when this 2-core CPU is too loaded to run the flow for long. Per iteration, as the flow's stages
do: 8 training prompts x 4 samples of at most 12 tokens at temperature 1 scored by ``smollm2_task:one_word``,
the reference's log-probs, GRPO advantages with a KL weight of 0.05 in the reward, one epoch of 4 minibatches
(LoRA r 16, lr 1e-4), then both the policy and the initial policy on the first 32 held-out prompts with the
same seeds: the held-out reward and the KL to the reference. The prompt order and seeds are not the flow's,
so the figures are the same settings' curve, not the same numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def chat_ids(tokenizer, path: Path) -> list[list[int]]:
    """Each prompt of a JSONL file of chat ``messages`` through the tokenizer's chat template."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        list(
            tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for row in rows
    ]


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the package's GGUF file (converted here), or --model")
    parser.add_argument("--model", type=Path, help="a Hugging Face folder of the model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(CONFIGS))
    from smollm2_task import one_word
    from transformers import AutoTokenizer

    from rlhf_core.config import AdvantageConfig, LoraConfig, PPOConfig, SamplingConfig
    from rlhf_core.evaluation import response_kl
    from rlhf_core.experience_maker import ExperienceMaker, score_experience
    from rlhf_core.generation import generate
    from rlhf_core.loading import ModelLoader
    from rlhf_core.ppo import ppo_update
    from rlhf_core.sequences import sequence_logprobs
    from runtime.models import accelerator_for

    started = time.perf_counter()
    folder = args.model
    if folder is None:
        from rlhf_core.gguf import convert_gguf

        folder = args.out.parent / "smollm2-folder"
        convert_gguf(args.gguf, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    train, held_out = (
        chat_ids(tokenizer, CONFIGS / "smollm2" / "prompts.jsonl"),
        chat_ids(tokenizer, CONFIGS / "smollm2" / "eval_prompts.jsonl")[:32],
    )
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, batch_size=64)
    advantages = AdvantageConfig(estimator="grpo", kl_coef=0.05)
    ppo = PPOConfig(epochs=1, minibatch_size=8, actor_learning_rate=1e-4)
    device = torch.device(args.device)
    models = ModelLoader(device=device, precision="fp32", bases={"policy": folder}, lora=LoraConfig(r=16, alpha=32))
    accelerator = accelerator_for(models.device, models.precision)
    actor = models.load("actor", folder, trainable=True)
    reference = models.reference(actor)
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=ppo.actor_learning_rate)
    actor, optimizer = accelerator.prepare(actor, optimizer)

    def responses(sequences: torch.Tensor, prompt_width: int, action_mask: torch.Tensor) -> list[str]:
        tokens = [row[mask.bool()].tolist() for row, mask in zip(sequences[:, prompt_width:], action_mask, strict=True)]
        return tokenizer.batch_decode(tokens, skip_special_tokens=True)

    def evaluate() -> dict[str, float]:
        ids, mask = left_pad(held_out, pad)
        ids, mask = ids.to(device), mask.to(device)
        result = {}
        with torch.no_grad():
            for side, policy in (("policy", actor), ("reference", reference)):
                out = generate(
                    policy, ids, mask, config=sampling, eos_token_id=eos, pad_token_id=pad,
                    generator=torch.Generator().manual_seed(1234),
                )  # fmt: skip
                texts = responses(out.sequences, ids.shape[1], out.action_mask)
                result[side] = sum(one_word(None, text) for text in texts) / len(texts)
                if side == "policy":
                    ref = sequence_logprobs(
                        reference, out.sequences, out.attention_mask, ids.shape[1], temperature=sampling.temperature
                    )
                    result["kl"] = float(response_kl(out.logprobs, ref, out.action_mask).mean())
        return result

    rows = []
    for iteration in range(args.iterations):
        tick = time.perf_counter()
        chosen = [train[(iteration * 8 + i * 7919) % len(train)] for i in range(8)]
        ids, mask = left_pad([row for row in chosen for _ in range(4)], pad)
        width = ids.shape[1]

        def score(sequences: torch.Tensor, attention_mask: torch.Tensor, width: int = width) -> torch.Tensor:
            texts = responses(sequences, width, attention_mask[:, width:])
            return torch.tensor([one_word(None, text) for text in texts], device=sequences.device)

        maker = ExperienceMaker(actor, None, score, reference, sampling=sampling, eos_token_id=eos, pad_token_id=pad)
        experience = maker.make_experience(
            ids,
            mask,
            group_ids=torch.arange(8).repeat_interleave(4),
            generator=torch.Generator().manual_seed(iteration),
        )
        scored = score_experience(experience, advantages)
        ppo_update(
            actor, None, optimizer, None, scored, ppo, accelerator=accelerator, temperature=1.0,
            norm_tokens=sampling.max_new_tokens, generator=torch.Generator().manual_seed(100 + iteration),
        )  # fmt: skip
        evaluation = evaluate()
        rows.append(
            {
                "iteration": iteration,
                "rollout_score": float(experience.scores.mean()),
                "initial_reward": evaluation["reference"],
                "reward": evaluation["policy"],
                "kl_to_reference": evaluation["kl"],
                "seconds": time.perf_counter() - tick,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seconds": time.perf_counter() - started,
        "iterations": rows,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
