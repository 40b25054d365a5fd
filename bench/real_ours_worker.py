"""Our GRPO iteration on SmolLM2 as a plain loop: the flow's stages' calls, models in memory, no files.

``.venv/bin/python -m bench.real_ours_worker --model DIR --prompts N --iterations 3 [--evaluate N] [--lora] --out FILE``

Per iteration, what ``configs/smollm2.yaml``'s rollout, compute_advantages and ppo_update stages do:
N prompts x G samples of at most R tokens scored by the reward function (``smollm2_task:one_word``), the
reference's log-probs, GRPO advantages, then ``ppo.epochs`` passes of minibatches; with ``--evaluate`` also
the evaluate stage (both policies on held-out prompts, the reward and the KL); with ``--lora`` the config's
adapters are trained (the reference is the actor with them off), else every weight. Each phase's wall and CPU
seconds are recorded per iteration (:class:`bench.common.Clock`). Against the TRL worker
(:mod:`bench.real_trl_worker`) it is our side of a step at equal work; against the flow it is the pipeline
tax's plain loop.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

from bench.common import REPO, Clock, set_threads

CONFIG = REPO / "configs" / "smollm2.yaml"


def run(
    model: Path,
    *,
    prompts: int,
    iterations: int,
    evaluate: int,
    lora: bool,
    clock: Clock,
    max_new_tokens: int | None = None,
    learning_rate: float | None = None,
) -> dict:
    """``iterations`` iterations; the config's sizes and settings unless given (``max_new_tokens``, ``learning_rate``)."""
    import torch

    from campaign.config import load_config
    from rlhf_core.evaluation import response_kl
    from rlhf_core.experience_maker import ExperienceMaker, score_experience
    from rlhf_core.generation import generate
    from rlhf_core.loading import ModelLoader
    from rlhf_core.ppo import ppo_update
    from rlhf_core.sequences import sequence_logprobs
    from runtime.models import accelerator_for
    from runtime.references import RewardFunctionReference
    from runtime.seeds import stage_seed
    from tasks.reward_function import score_texts
    from tasks.rollout import ROLLOUT_PROMPT_OFFSET, function_scorer
    from tasks.tensors import encode_prompts, response_token_lists
    from tasks.text import decode, load_tokenizer, prompt_text, read_prompts, rotating_subset

    # 4 optimizer steps per iteration whatever the batch, as the config's 64 rollouts in minibatches of 16
    group = load_config(CONFIG).sizes.samples_per_prompt
    overrides = [
        f"model.policy={model}",
        f"sizes.rollout_prompts={prompts}",
        f"ppo.minibatch_size={prompts * group // 4}",
    ]
    overrides += [f"sampling.max_new_tokens={max_new_tokens}"] if max_new_tokens else []
    overrides += [f"ppo.actor_learning_rate={learning_rate}"] if learning_rate else []
    config = load_config(CONFIG, overrides)
    sampling = config.sampling
    tokenizer = load_tokenizer(str(model))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    train_prompts = read_prompts(config.data.prompts)
    held_out = read_prompts(config.data.eval_prompts)[:evaluate]
    reward_function = RewardFunctionReference.of(config.reward.function)
    models = ModelLoader(
        device=torch.device("cpu"),
        precision=config.precision,
        bases={"policy": model},
        lora=config.model.lora if lora else None,
    )
    accelerator = accelerator_for(models.device, models.precision)
    actor = models.load("actor", model, trainable=True)
    reference = models.reference(actor)
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=config.ppo.actor_learning_rate)
    actor, optimizer = accelerator.prepare(actor, optimizer)
    rollouts, steps, results = [], [], []

    def seeded(stage: str, iteration: int) -> torch.Generator:
        return torch.Generator().manual_seed(stage_seed(config.seed, stage, iteration))

    for iteration in range(iterations):
        with clock.measure("iteration"):
            # 1. rollout: G samples of each prompt, scored by the function and the reference
            with clock.measure("rollout"):
                chosen = rotating_subset(
                    train_prompts, count=prompts, iteration=iteration, offset=ROLLOUT_PROMPT_OFFSET
                )
                batch = [prompt for _, prompt in chosen for _ in range(group)]
                group_ids = [index for index, _ in chosen for _ in range(group)]
                ids, mask = encode_prompts(tokenizer, [prompt for _, prompt in chosen])
                ids, mask = ids.repeat_interleave(group, dim=0), mask.repeat_interleave(group, dim=0)  # (N * G, P)
                score = function_scorer(reward_function, tokenizer, batch, group_ids, ids.shape[1])
                maker = ExperienceMaker(
                    actor, None, score, reference, sampling=sampling, eos_token_id=eos, pad_token_id=pad
                )
                experience = maker.make_experience(
                    ids, mask, group_ids=torch.tensor(group_ids), generator=seeded("rollout", iteration)
                )
            # 2. GRPO advantages
            with clock.measure("compute_advantages"):
                scored = score_experience(experience, config.advantages)
            # 3. the update
            with clock.measure("ppo_update"):
                stats = ppo_update(
                    actor,
                    None,
                    optimizer,
                    None,
                    scored,
                    config.ppo,
                    accelerator=accelerator,
                    temperature=sampling.temperature,
                    generator=seeded("ppo_update", iteration),
                    norm_tokens=sampling.max_new_tokens,
                )
            # 4. evaluate: both policies on the held-out prompts, the same seed for both
            if evaluate:
                with clock.measure("evaluate"):
                    ids, mask = encode_prompts(tokenizer, held_out)
                    scores, kls = {}, []
                    for side, policy in (("policy", actor), ("reference", reference)):
                        with torch.no_grad():
                            out = generate(
                                policy, ids, mask, config=sampling, eos_token_id=eos, pad_token_id=pad,
                                generator=seeded("evaluate", 0),
                            )  # fmt: skip
                            responses = decode(tokenizer, response_token_lists(out.sequences, out.action_mask))
                            scores[side] = score_texts(
                                reward_function.load(), reward_function.name, held_out, responses,
                                range(len(held_out)), prompt_texts=[prompt_text(tokenizer, p) for p in held_out],
                            ).mean()  # fmt: skip
                            if side == "policy":
                                ref = sequence_logprobs(
                                    reference, out.sequences, out.attention_mask, ids.shape[1],
                                    temperature=sampling.temperature,
                                )  # fmt: skip
                                kls.append(response_kl(out.logprobs, ref, out.action_mask).mean())
                    results.append({"reward": float(scores["policy"]), "kl": float(kls[0])})
        rollouts.append(int(experience.action_mask.shape[0]))
        steps.append(stats.optimizer_steps)
    return {
        "side": "ours",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rollouts_per_iteration": rollouts,
        "generated_tokens_per_iteration": None,
        "optimizer_steps_per_iteration": steps[-1],
        "evaluation": results,
        "phases": clock.to_json(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration (x G samples)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--evaluate", type=int, default=0, help="held-out prompts evaluated per iteration (0: none)")
    parser.add_argument("--lora", action="store_true", help="train the config's LoRA adapters, not every weight")
    parser.add_argument("--max-new-tokens", type=int, help="instead of the config's")
    parser.add_argument("--learning-rate", type=float, help="instead of the config's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_threads(args.threads)
    result = run(
        args.model, prompts=args.prompts, iterations=args.iterations, evaluate=args.evaluate, lora=args.lora,
        clock=Clock(), max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate,
    )  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
