"""Stage 7, evaluate: the policy against the frozen initial policy on held-out prompts.

Reports the reward model's score, the gold score (where the hidden gold rubric applies), the
gold win rate of policy samples against initial-policy samples for the same prompt (ties count
half), and the KL to the reference (mean over responses of the summed per-token k1 estimate).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rlhf_core.experience_maker import reference_logprobs
from rlhf_core.generation import generate
from rlhf_core.models import evaluating, freeze
from storage.checkpoints import load_causal_lm, load_reward_model
from storage.manifest import StageOutput
from tasks.runtime import IterationContext, StageResult, run_stage, stage_state
from tasks.text import batches, decode, encode_prompts, load_tokenizer, read_prompt_texts, response_token_lists

STAGE = "evaluate"


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


@task(name=STAGE, cache_policy=NO_CACHE)
def evaluate(context: IterationContext, policy: StageResult, reward_model: StageResult) -> State:
    """Write ``samples.jsonl`` and return the evaluation metrics."""
    config = context.config
    sampling = dataclasses.replace(config.sampling, num_samples=1)

    def produce(out: StageOutput) -> dict[str, float]:
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        actor = load_causal_lm(policy.directory / "actor")
        reference = freeze(load_causal_lm(context.base.policy_dir))
        scorer = load_reward_model(reward_model.directory / "reward_model")
        prompts = read_prompt_texts(context.base.eval_prompts_path)[: config.sizes.eval_prompts]
        records, kl_per_response = [], []
        for part in batches(len(prompts), sampling.batch_size):
            prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts[part])
            texts, scores = {}, {}
            for name, model in (("policy", actor), ("reference", reference)):
                generator = torch.Generator().manual_seed(context.seed(STAGE) + part.start)
                generation = generate(
                    model,
                    prompt_ids,
                    prompt_mask,
                    config=sampling,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    generator=generator,
                )
                texts[name] = decode(tokenizer, response_token_lists(generation.sequences, generation.action_mask))
                with evaluating(scorer), torch.no_grad():
                    scores[name] = scorer(generation.sequences, generation.attention_mask).tolist()
                if name == "policy":
                    ref = reference_logprobs(
                        reference,
                        generation.sequences,
                        generation.attention_mask,
                        prompt_ids.shape[1],
                        temperature=sampling.temperature,
                    )
                    kl_per_response += ((generation.logprobs - ref) * generation.action_mask).sum(dim=1).tolist()
            for row, prompt in enumerate(prompts[part]):
                records.append(
                    {
                        "prompt": prompt,
                        **{f"{name}_response": texts[name][row] for name in texts},
                        **{f"{name}_reward": scores[name][row] for name in scores},
                    }
                )
        metrics = {
            "reward_mean": _mean([r["policy_reward"] for r in records]),
            "reference_reward_mean": _mean([r["reference_reward"] for r in records]),
            "kl_to_reference": _mean(kl_per_response),
        }
        if context.base.gold_available:
            metrics.update(_gold_metrics(records))
        (out.path / "samples.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        return metrics

    slice_ = {
        "sampling": dataclasses.asdict(sampling),
        "prompts": config.sizes.eval_prompts,
        "seed": config.seed,
        "gold": context.base.gold_available,
    }
    return stage_state(
        run_stage(
            context, STAGE, config=slice_, upstream={"policy": policy, "reward_model": reward_model}, produce=produce
        )
    )


def _gold_metrics(records: list[dict]) -> dict[str, float]:
    """Gold scores of both sides and the policy's gold win rate (ties count half); annotates records."""
    from demo.gold import gold_score

    wins = []
    for record in records:
        record["policy_gold"] = gold_score(record["prompt"], record["policy_response"])
        record["reference_gold"] = gold_score(record["prompt"], record["reference_response"])
        gap = record["policy_gold"] - record["reference_gold"]
        wins.append(1.0 if gap > 0 else 0.5 if gap == 0 else 0.0)
    return {
        "gold_mean": _mean([r["policy_gold"] for r in records]),
        "reference_gold_mean": _mean([r["reference_gold"] for r in records]),
        "gold_win_rate": _mean(wins),
    }
