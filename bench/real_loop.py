"""Issue 35 on SmolLM2-135M-Instruct: the choices of the learned-reward loop, each measured, and its learning curve.

``.venv/bin/python -m bench.real_loop pairs``   (which pairing gives the better reward model per second of sampling)
``.venv/bin/python -m bench.real_loop pairs-file``  (configs/smollm2/rubric_pairs.jsonl: pairs in UltraFeedback's shape)
``.venv/bin/python -m bench.real_loop critic``  (the critic from the policy or from the reward model; warm-up steps)
``.venv/bin/python -m bench.real_loop critic-start --read-back RUN_ROOT`` (issue 43: a loop's first critic, from its
reward model with the score normalisation folded into the head, or not, or a fresh head, on that loop's first rollout)
``.venv/bin/python -m bench.real_loop lora``    (a PPO update of actor and critic: LoRA against full fine-tuning)
``.venv/bin/python -m bench.real_loop loop``    (the curve: ``rlhf run --config configs/smollm2-rm.yaml``)
``.venv/bin/python -m bench.real_loop choices`` (the tables of ``pairs``, ``critic`` and ``lora``, from their files)
``.venv/bin/python -m bench.real_loop episodes`` (issue 44: ``rlhf run --config configs/smollm2-episodes.yaml``, the
one-word task as episodes with feedback; success at turn 1, recovery at turn 2 and final success per iteration)
``.venv/bin/python -m bench.real_loop decisive`` (issue 43: on a sparse binary task, more candidates for the prompts
whose candidates all tied, or fresh prompts: which finds more decisive pairs per sampled token)
``.venv/bin/python -m bench.real_loop sft``     (issue 45: ``rlhf run --config configs/smollm2-sft.yaml``, SFT then
GRPO, against ``configs/smollm2.yaml``, GRPO alone, for as many iterations)
``.venv/bin/python -m bench.real_loop dpo``     (issue 45: ``rlhf run --config configs/smollm2-dpo.yaml``, iterative
DPO on the rubric's labels)

``pairs``, ``critic`` and ``lora`` are plain loops of the stages' own functions (sampling, the rubric labeler and
:mod:`tasks.pairing`, :func:`rlhf_core.reward_training.fit_reward_model`, the model seam, the value loss, the PPO
update), with the models in memory: each answers one question in minutes where the flow would take an hour.

* ``pairs``: 4 candidates for each of 64 training prompts (one-word task, 16 new tokens, temperature 1), scored by
  ``smollm2_task:one_word``. Four pair sets from the same sampling budget, 128 candidates each: consecutive pairs
  of 2 candidates of 64 prompts; consecutive, best-vs-worse and all-decisive pairs of 4 candidates of 32 prompts.
  A reward model (LoRA, the loop's settings) learns from each; its accuracy is measured on every decisive pair of 4
  candidates of 32 held-out prompts (topics no training prompt has).
* ``critic``: 2 x 64 rollouts of the initial policy scored by the ``pairs`` part's best reward model; critics from
  the policy (a fresh value head) and from that reward model learn the returns of the first 64 rollouts (value
  loss, no actor step: a warm-up) and are scored on the other 64 (explained variance) after 0, 4, 8 and 16 steps.
* ``critic-start``: a finished ``loop`` run's iteration 0 (``--read-back``, default the ``loop`` part's run root): its
  rollout as ``compute_advantages`` scored it, and the reward model the critic started from. Each start's values of
  that rollout's tokens (no step taken), against its returns: the GAE returns the update used, the Monte Carlo
  returns (gamma 1, lambda 1: no critic in them), at every response token and at the last one (where a reward model
  is trained); explained variance and the mean absolute value. Starts: the reward model with its held-out score mean
  and std folded into the head (what the campaign does), without the fold, and a fresh value head on the policy.
* ``lora``: one rollout of 32 and a PPO update of actor and critic (4 minibatches of 8), full fine-tuning against
  LoRA r 16, each in a process of its own (peak resident memory), with what it writes per iteration.
* ``loop``: the flow itself, ``rlhf run --config configs/smollm2-rm.yaml`` on a fresh run root, read back from its
  MLflow store per iteration (the reward model's held-out accuracy, its score and the rubric's of the policy and of
  the initial policy on held-out prompts, the KL to the reference, the critic's explained variance, the reward's
  length correlation, the share of decisive pairs, seconds per stage) and the over-optimisation figure it logged.
  ``--resume`` goes on with a stopped run's run root, as the same ``rlhf run`` would, where a fresh run deletes it.

* ``episodes``: the flow, ``rlhf run --config configs/smollm2-episodes.yaml`` on a fresh run root; per iteration, the
  campaign's own evaluation on held-out episodes (MLflow) of the updated policy against the initial policy, and its
  rollout's episodes (training prompts, the policy that sampled them) from the ``turns`` table, measured alike
  (:func:`tasks.episode_evaluation.side_metrics`): success by turn 1, 2 and 3 (final), recovery (a failed first
  turn that succeeded later), turns per episode and the episode reward.

* ``sft``: the flow twice, each on a fresh run root: ``configs/smollm2-sft.yaml`` (the ``sft`` stage on
  configs/smollm2/sft.jsonl, then the GRPO iterations from the SFT model) and ``configs/smollm2.yaml`` (the same
  iterations from the pretrained model), ``--iterations`` each (default 2). From MLflow: the ``sft`` stage's
  steps, first and last step loss and seconds; per iteration of each campaign the held-out rubric
  (``evaluate/reward_mean``: the reward is the rubric) of the policy and of its initial policy (the pretrained one,
  or the SFT model), the KL to that initial policy, seconds.
* ``dpo``: the flow, ``rlhf run --config configs/smollm2-dpo.yaml`` on a fresh run root; per iteration from MLflow,
  the held-out rubric (``evaluate/rubric_mean``) against the initial policy's, the KL to the reference (the initial
  policy), the update's pairs and TRL metrics on them, seconds per stage.

Every part writes ``bench/.scratch/real-loop-PART.json`` with the machine's load at its start and end: the machine
is shared, so its wall seconds are the load's as much as the code's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, SCRATCH, machine
from bench.smollm2 import ensure_folder

CONFIG = REPO / "configs" / "smollm2-rm.yaml"
CAMPAIGN = "smollm2-one-word-rm"
STAGES = (
    "sample_candidates",
    "collect_preferences",
    "train_reward_model",
    "rollout",
    "compute_advantages",
    "ppo_update",
    "evaluate",
)
NEW_TOKENS = 16
LORA = {"r": 16, "alpha": 32}
REWARD_MODEL = {"learning_rate": 1e-4, "epochs": 2, "batch_size": 8}
"""The reward model's training in ``pairs`` (and the loop's: configs/smollm2-rm.yaml)."""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _setup():
    """The model folder, its tokenizer and the task's prompt files."""
    import torch

    from tasks.text import load_tokenizer, read_prompts

    torch.set_num_threads(1)
    folder = ensure_folder()
    tokenizer = load_tokenizer(str(folder))
    train = read_prompts(REPO / "configs" / "smollm2" / "prompts.jsonl")
    held_out = read_prompts(REPO / "configs" / "smollm2" / "eval_prompts.jsonl")
    return folder, tokenizer, train, held_out


def sample_candidates(actor, tokenizer, prompts, *, per_prompt: int, seed: int):
    """``per_prompt`` responses to each prompt, as the ``candidates`` table the stage writes, and the seconds."""
    import pyarrow as pa
    import torch

    from rlhf_core.config import SamplingConfig
    from rlhf_core.generation import sample_candidates as sample
    from storage.schemas import CANDIDATES
    from tasks.tensors import encode_prompts, prompt_token_lists, response_token_lists
    from tasks.text import decode

    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, batch_size=64)
    rows, generator, started = [], torch.Generator().manual_seed(seed), time.perf_counter()
    batch = sampling.batch_size // per_prompt
    for start in range(0, len(prompts), batch):
        part = prompts[start : start + batch]
        ids, mask = encode_prompts(tokenizer, part)
        with torch.no_grad():
            generation = sample(
                actor, ids, mask, num_samples=per_prompt, config=sampling, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, generator=generator,
            )  # fmt: skip
        prompt_lists = prompt_token_lists(ids, mask)
        responses = response_token_lists(generation.sequences, generation.action_mask)
        texts = decode(tokenizer, responses)
        for row in range(len(texts)):
            prompt = part[row // per_prompt]
            rows.append(
                {
                    "prompt_id": start + row // per_prompt, "candidate_index": row % per_prompt,
                    "prompt": prompt.text, "messages": list(prompt.messages), "response": texts[row],
                    "prompt_ids": prompt_lists[row // per_prompt], "response_ids": responses[row],
                    "old_logprobs": None, "engine_logprobs": None,
                }
            )  # fmt: skip
    return pa.Table.from_pylist(rows, schema=CANDIDATES), time.perf_counter() - started


def preference_sets(candidates, held_out_candidates, rubric):
    """The four pair sets of equal sampling (128 candidates each), and the held-out decisive pairs."""
    import pyarrow.compute as pc

    from tasks.collect_preferences import candidate_groups, paired_table

    def pairs(table, pairing, prompts, candidates_per_prompt):
        keep = pc.and_(pc.less(table["prompt_id"], prompts), pc.less(table["candidate_index"], candidates_per_prompt))
        groups = candidate_groups(table.filter(keep), pairing=pairing)
        return paired_table(groups, rubric, pairing, seed=0, first_pair_id=0)

    sets = {
        "consecutive, 2 of 64 prompts": pairs(candidates, "consecutive", 64, 2),
        "consecutive, 4 of 32 prompts": pairs(candidates, "consecutive", 32, 4),
        "best_vs_worse, 4 of 32 prompts": pairs(candidates, "best_vs_worse", 32, 4),
        "all_decisive, 4 of 32 prompts": pairs(candidates, "all_decisive", 32, 4),
    }
    held_out, _ = pairs(held_out_candidates, "all_decisive", 32, 4)
    return sets, held_out


def train_reward_model(folder, tokenizer, table, held_out, *, seed: int = 0):
    """A reward model from the policy's backbone (LoRA) trained on ``table``; its held-out figures and seconds."""
    import torch

    from rlhf_core.config import LoraConfig, RewardModelConfig
    from rlhf_core.loading import ModelLoader
    from rlhf_core.reward_training import fit_reward_model
    from runtime.models import accelerator_for
    from tasks.train_reward_model import preference_batch

    config = RewardModelConfig(**REWARD_MODEL)
    models = ModelLoader(
        device=torch.device("cpu"), precision="fp32", bases={"policy": folder}, lora=LoraConfig(**LORA)
    )
    torch.manual_seed(seed)
    model = models.load("reward_model", folder, trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    accelerator = accelerator_for(models.device, models.precision)
    model, optimizer = accelerator.prepare(model, optimizer)
    started = time.perf_counter()
    stats = fit_reward_model(
        model, optimizer, preference_batch(table, tokenizer), preference_batch(held_out, tokenizer), config,
        accelerator=accelerator, generator=torch.Generator().manual_seed(seed), dropout_seed=seed,
    )  # fmt: skip
    return accelerator.unwrap_model(model), stats, time.perf_counter() - started


def pairs_part(out: Path) -> dict:
    import torch
    from smollm2_task import one_word

    from rlhf_core.loading import ModelLoader, save_model_folder
    from tasks.labelers import FunctionLabeler

    folder, tokenizer, train, held_out = _setup()
    started_load = load()
    models = ModelLoader(device=torch.device("cpu"), precision="fp32", bases={"policy": folder})
    actor = models.load("actor", folder)
    candidates, sampling_seconds = sample_candidates(actor, tokenizer, train[:64], per_prompt=4, seed=1)
    held_out_candidates, _ = sample_candidates(actor, tokenizer, held_out[:32], per_prompt=4, seed=2)
    per_candidate = sampling_seconds / candidates.num_rows
    sets, held_out_pairs = preference_sets(candidates, held_out_candidates, FunctionLabeler(one_word, "one_word"))
    results, best = {}, None
    for name, (table, metrics) in sets.items():
        model, stats, seconds = train_reward_model(folder, tokenizer, table, held_out_pairs)
        results[name] = {
            "pairs": table.num_rows,
            "decisive_fraction": metrics["decisive_fraction"],
            "sampling_seconds": 128 * per_candidate,
            "training_seconds": seconds,
            "eval_accuracy": stats.eval_accuracy,
            "eval_loss": stats.eval_loss,
            "train_accuracy": stats.train_accuracy,
        }
        print(name, json.dumps(results[name]), flush=True)
        if best is None or stats.eval_accuracy > results[best]["eval_accuracy"]:
            best = name
            save_model_folder(model, SCRATCH / "real-loop-reward-model", weights=True)
            tokenizer.save_pretrained(SCRATCH / "real-loop-reward-model")
    result = {
        "machine": machine(),
        "load_average_start": started_load,
        "load_average_end": load(),
        "candidates_sampled": candidates.num_rows,
        "seconds_per_candidate": per_candidate,
        "held_out_pairs": held_out_pairs.num_rows,
        "sets": results,
        "best": best,
    }
    out.write_text(json.dumps(result, indent=2))
    return result


def _decisive(scores: list[list[float]]) -> dict[str, int]:
    """Per prompt's candidate scores: the prompts with a winner, and the pairs ``best_vs_worse`` (one a prompt with a
    winner) and ``all_decisive`` (every pair of unequal scores) make of them."""
    decisive = [group for group in scores if len(set(group)) > 1]
    pairs = sum(sum(a != b for i, a in enumerate(group) for b in group[i + 1 :]) for group in decisive)
    return {"decisive_prompts": len(decisive), "best_vs_worse": len(decisive), "all_decisive": pairs}


def decisive_part(out: Path, *, prompts: int = 64, per_prompt: int = 4) -> dict:
    """Issue 43: ``per_prompt`` candidates of ``prompts`` training prompts, scored by the sparse binary rubric
    (``smollm2_task:exactly_one_word``); then, from the same budget (``per_prompt`` more candidates for each prompt
    whose candidates all tied), either more candidates of those prompts (``top_up``) or ``per_prompt`` candidates of
    as many fresh prompts (``fresh``): the decisive pairs each adds per 1000 sampled response tokens."""
    import torch
    from smollm2_task import exactly_one_word

    from rlhf_core.loading import ModelLoader

    folder, tokenizer, train, _ = _setup()
    started_load = load()
    actor = ModelLoader(device=torch.device("cpu"), precision="fp32", bases={"policy": folder}).load("actor", folder)

    def scored(table) -> dict[int, list[float]]:
        groups: dict[int, list[float]] = {}
        for row in table.to_pylist():
            groups.setdefault(row["prompt_id"], []).append(exactly_one_word(row["prompt"], row["response"]))
        return groups

    def tokens(table) -> int:
        return sum(len(ids) for ids in table.column("response_ids").to_pylist())

    first, _ = sample_candidates(actor, tokenizer, train[:prompts], per_prompt=per_prompt, seed=1)
    first_scores = scored(first)
    tied = sorted(prompt for prompt, group in first_scores.items() if len(set(group)) == 1)
    top_up, _ = sample_candidates(actor, tokenizer, [train[i] for i in tied], per_prompt=per_prompt, seed=2)
    more = scored(top_up)  # prompt ids count from 0 over the tied prompts
    joined = [first_scores[prompt] + more[index] for index, prompt in enumerate(tied)]
    fresh, _ = sample_candidates(actor, tokenizer, train[prompts : prompts + len(tied)], per_prompt=per_prompt, seed=2)
    result = {
        "machine": machine(),
        "load_average_start": started_load,
        "prompts": prompts,
        "candidates_per_prompt": per_prompt,
        "base_rate": sum(map(sum, first_scores.values())) / first.num_rows,
        "first_round": {**_decisive(list(first_scores.values())), "tokens": tokens(first)},
        "tied_prompts": len(tied),
        "tied_all_failed": sum(1 for prompt in tied if first_scores[prompt][0] == 0.0),
        "top_up": {**_decisive(joined), "tokens": tokens(top_up)},
        "fresh": {**_decisive(list(scored(fresh).values())), "tokens": tokens(fresh)},
        "load_average_end": load(),
    }
    for way in ("first_round", "top_up", "fresh"):
        part = result[way]
        part["all_decisive_per_1000_tokens"] = 1000 * part["all_decisive"] / max(part["tokens"], 1)
        part["best_vs_worse_per_1000_tokens"] = 1000 * part["best_vs_worse"] / max(part["tokens"], 1)
    print(json.dumps(result, indent=2), flush=True)
    out.write_text(json.dumps(result, indent=2))
    return result


PAIRS_FILE = REPO / "configs" / "smollm2" / "rubric_pairs.jsonl"


def pairs_file_part(prompts: int) -> Path:
    """Write :data:`PAIRS_FILE`: a preference dataset in UltraFeedback's binarised shape, made by the rubric."""
    import torch
    from smollm2_task import one_word

    from rlhf_core.loading import ModelLoader
    from tasks.collect_preferences import candidate_groups, paired_table
    from tasks.labelers import FunctionLabeler

    folder, tokenizer, train, _ = _setup()
    models = ModelLoader(device=torch.device("cpu"), precision="fp32", bases={"policy": folder})
    candidates, _ = sample_candidates(models.load("actor", folder), tokenizer, train[:prompts], per_prompt=4, seed=3)
    groups = candidate_groups(candidates, pairing="best_vs_worse")
    table, _ = paired_table(groups, FunctionLabeler(one_word, "one_word"), "best_vs_worse", seed=0, first_pair_id=0)
    rows = []
    for index, pair in enumerate(table.to_pylist()):
        conversation = list(pair["messages"])
        rows.append(
            {
                "prompt": conversation[-1]["content"], "prompt_id": f"rubric-{index}",
                "chosen": [*conversation, {"role": "assistant", "content": pair["chosen"]}],
                "rejected": [*conversation, {"role": "assistant", "content": pair["rejected"]}],
                "score_chosen": one_word(None, pair["chosen"]), "score_rejected": one_word(None, pair["rejected"]),
            }
        )  # fmt: skip
    PAIRS_FILE.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} pairs of {prompts} prompts to {PAIRS_FILE}", flush=True)
    return PAIRS_FILE


def critic_part(out: Path) -> dict:
    import torch

    from rlhf_core.config import AdvantageConfig, LoraConfig, SamplingConfig
    from rlhf_core.experience_maker import ExperienceMaker, score_experience
    from rlhf_core.loading import ModelLoader
    from rlhf_core.losses import value_loss
    from rlhf_core.models import evaluating
    from rlhf_core.ppo import explained_variance
    from rlhf_core.sequences import response_slice
    from tasks.rollout import model_scorer
    from tasks.tensors import encode_prompts, reward_scorer

    folder, tokenizer, train, _ = _setup()
    reward_folder = SCRATCH / "real-loop-reward-model"
    pairs = json.loads((SCRATCH / "real-loop-pairs.json").read_text())
    started_load = load()
    models = ModelLoader(
        device=torch.device("cpu"), precision="fp32", bases={"policy": folder}, lora=LoraConfig(**LORA)
    )
    actor = models.load("actor", folder)
    scorer = reward_scorer(
        models.load("reward_model", reward_folder), policy_tokenizer_dir=str(folder), reward_tokenizer_dir=str(folder)
    )
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, batch_size=64)
    rollouts = []
    for index, part in enumerate((train[100:164], train[200:264])):
        ids, mask = encode_prompts(tokenizer, part)
        maker = ExperienceMaker(
            actor, None, model_scorer(scorer, part, ids.shape[1]), actor, sampling=sampling,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        rollouts.append(maker.make_experience(ids, mask, generator=torch.Generator().manual_seed(10 + index)))
    # The returns the critic learns: the normalised score at every token (gamma 1, lambda 1: no critic in them).
    scores = torch.cat([rollout.scores for rollout in rollouts])
    mean, std = float(scores.mean()), float(scores.std())
    config = AdvantageConfig(estimator="reinforce_pp", kl_coef=0.0)  # its returns: the rewards' return
    targets = [score_experience(rollout, config, score_mean=mean, score_std=std) for rollout in rollouts]
    results = {}
    for init, source in (("policy", folder), ("reward_model", reward_folder)):
        torch.manual_seed(0)
        critic = models.load("critic", source, trainable=True)
        optimizer = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=1e-4)

        def score_on_held_out(critic=critic) -> float:
            batch = targets[1]
            with torch.no_grad(), evaluating(critic):
                values = response_slice(
                    critic(batch.sequences, batch.attention_mask), batch.sequences.shape[1] - batch.action_mask.shape[1]
                )
            return float(explained_variance(values, batch.returns, batch.action_mask))

        curve, steps, started = {0: score_on_held_out()}, 0, time.perf_counter()
        order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
        batch_all = targets[0]
        width = batch_all.sequences.shape[1] - batch_all.action_mask.shape[1]
        while steps < 16:
            rows = order[(steps % 4) * 16 : (steps % 4) * 16 + 16]
            values = response_slice(critic(batch_all.sequences[rows], batch_all.attention_mask[rows]), width)
            loss, _ = value_loss(values, values.detach(), batch_all.returns[rows], batch_all.action_mask[rows],
                                 value_clip_eps=None)  # fmt: skip
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            optimizer.step()
            steps += 1
            if steps in (4, 8, 16):
                curve[steps] = score_on_held_out()
        results[init] = {"explained_variance": curve, "seconds_per_step": (time.perf_counter() - started) / 16}
        print(init, json.dumps(results[init]), flush=True)
    result = {
        "machine": machine(),
        "load_average_start": started_load,
        "load_average_end": load(),
        "reward_model": pairs["best"],
        "rollouts": [len(r.scores) for r in rollouts],
        "critics": results,
    }
    out.write_text(json.dumps(result, indent=2))
    return result


def critic_start_part(out: Path, run_root: Path) -> dict:
    """The first critic's values of the loop's first rollout, from each start, against its returns (module doc)."""
    import pyarrow.parquet as pq
    import torch

    from rlhf_core.loading import ModelLoader
    from rlhf_core.ppo import explained_variance
    from storage.manifest import read_manifest

    (campaign,) = [path for path in run_root.iterdir() if (path / "compute_advantages").is_dir()]
    scored = [path for path in (campaign / "compute_advantages").iterdir() if (path / "_manifest.json").is_file()]
    (first,) = [path for path in scored if "previous" not in read_manifest(path, verify=False).upstream]
    wanted = read_manifest(first, verify=False).upstream["reward_model"]
    trained = [p for p in (campaign / "train_reward_model").iterdir() if (p / "_manifest.json").is_file()]
    (reward_model,) = [path for path in trained if read_manifest(path, verify=False).digest == wanted]
    statistics = read_manifest(reward_model, verify=False).metrics
    rows = pq.read_table(sorted(first.glob("scored_experience-*.parquet"))).to_pylist()
    width = max(len(row["response_ids"]) for row in rows)

    def padded(lists: list[list[float]]) -> torch.Tensor:  # (B, R)
        return torch.tensor([values + [0.0] * (width - len(values)) for values in lists])

    mask = padded([[1.0] * len(row["response_ids"]) for row in rows]).bool()
    last = padded([[0.0] * (len(row["response_ids"]) - 1) + [1.0] for row in rows]).bool()
    returns = {
        "gae": padded([row["returns"] for row in rows]),
        "monte_carlo": padded([[sum(row["rewards"][t:]) for t in range(len(row["rewards"]))] for row in rows]),
    }
    policy = ensure_folder()
    models = ModelLoader(device=torch.device("cpu"), precision="fp32", bases={"policy": policy})

    def values(critic: torch.nn.Module) -> torch.Tensor:  # each row alone: no padding in the measure
        out_rows = []
        with torch.no_grad():
            for row in rows:
                sequence = torch.tensor([row["prompt_ids"] + row["response_ids"]])
                per_position = critic(sequence, torch.ones_like(sequence))[0]
                out_rows.append(per_position[len(row["prompt_ids"]) - 1 : -1].tolist())
        return padded(out_rows)

    torch.manual_seed(0)
    starts = {
        "reward_model, folded": models.load(
            "critic",
            reward_model / "reward_model",
            score_statistics=(statistics["score_mean"], statistics["score_std"]),
        ),
        "reward_model, unfolded": models.load("critic", reward_model / "reward_model"),
        "policy, fresh head": models.load("critic", policy, trainable=True),
    }
    predicted_by, critics = {name: values(critic) for name, critic in starts.items()}, {}
    for name, predicted in predicted_by.items():
        critics[name] = {
            "mean_abs_value": float(predicted[mask].abs().mean()),
            **{
                f"ev_{kind}_{where}": float(explained_variance(predicted, target, positions))
                for kind, target in returns.items()
                for where, positions in (("all", mask), ("last", last))
            },
        }
        print(name, json.dumps(critics[name]), flush=True)
    stored = padded([row["old_values"] for row in rows])
    result = {
        "machine": machine(),
        "run_root": str(run_root),
        "rollouts": len(rows),
        "reward_model_score_mean": statistics["score_mean"],
        "reward_model_score_std": statistics["score_std"],
        "rollout_score_mean": sum(row["scores"] for row in rows) / len(rows),
        "mean_abs_return": float(returns["monte_carlo"][mask].abs().mean()),
        "campaign_values_reproduced": float((predicted_by["reward_model, folded"] - stored)[mask].abs().max()),
        "critics": critics,
    }
    out.write_text(json.dumps(result, indent=2))
    return result


def lora_worker(mode: str, out: Path) -> None:
    """One rollout of 32 and a PPO update of actor and critic, fully fine-tuned or with LoRA, timed; and what the
    update writes (its output folder) measured."""
    import torch

    from rlhf_core.config import AdvantageConfig, LoraConfig, PPOConfig, SamplingConfig
    from rlhf_core.experience_maker import ExperienceMaker, score_experience
    from rlhf_core.loading import ModelLoader, save_model_folder
    from rlhf_core.ppo import ppo_update
    from runtime.models import accelerator_for
    from tasks.tensors import encode_prompts

    folder, tokenizer, train, _ = _setup()
    lora = LoraConfig(**LORA) if mode == "lora" else None
    models = ModelLoader(device=torch.device("cpu"), precision="fp32", bases={"policy": folder}, lora=lora)
    accelerator = accelerator_for(models.device, models.precision)
    torch.manual_seed(0)
    loaded = time.perf_counter()
    actor = models.load("actor", folder, trainable=True)
    critic = models.load("critic", folder, trainable=True)
    reference = models.reference(actor)
    rate = 1e-4 if lora else 2e-5
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=rate) for m in (actor, critic)]
    actor, critic, *optimizers = accelerator.prepare(actor, critic, *optimizers)
    load_seconds = time.perf_counter() - loaded
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, batch_size=64)
    prompts = train[:32]
    ids, mask = encode_prompts(tokenizer, prompts)
    lengths = torch.tensor([float(len(p.text)) for p in prompts])
    maker = ExperienceMaker(
        actor, critic, lambda sequences, attention: lengths.clone(), reference, sampling=sampling,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    tick, cpu = time.perf_counter(), time.process_time()
    experience = maker.make_experience(ids, mask, generator=torch.Generator().manual_seed(0))
    rollout = (time.perf_counter() - tick, time.process_time() - cpu)
    scored = score_experience(experience, AdvantageConfig(kl_coef=0.05), score_mean=float(lengths.mean()), score_std=1)
    tick, cpu = time.perf_counter(), time.process_time()
    ppo_update(
        actor, critic, optimizers[0], optimizers[1], scored, PPOConfig(epochs=1, minibatch_size=8),
        accelerator=accelerator, temperature=1.0, norm_tokens=NEW_TOKENS, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    update = (time.perf_counter() - tick, time.process_time() - cpu)
    written = SCRATCH / f"real-loop-lora-{mode}"
    shutil.rmtree(written, ignore_errors=True)
    tick = time.perf_counter()
    for name, model, optimizer in (("actor", actor, optimizers[0]), ("critic", critic, optimizers[1])):
        save_model_folder(accelerator.unwrap_model(model), written / name)
        torch.save(optimizer.state_dict(), written / f"{name}_optimizer.pt")
    save_seconds = time.perf_counter() - tick
    out.write_text(
        json.dumps(
            {
                "mode": mode,
                "trained_parameters": sum(
                    p.numel() for m in (actor, critic) for p in m.parameters() if p.requires_grad
                ),
                "load_seconds": load_seconds,
                "rollout_wall_cpu": rollout,
                "update_wall_cpu": update,
                "save_seconds": save_seconds,
                "written_bytes": sum(p.stat().st_size for p in written.rglob("*") if p.is_file()),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )
    shutil.rmtree(written, ignore_errors=True)


def lora_part(out: Path) -> dict:
    started_load, runs = load(), {}
    for mode in ("full", "lora"):
        path = SCRATCH / f"real-loop-lora-{mode}.json"
        subprocess.run(
            [sys.executable, "-m", "bench.real_loop", "lora-worker", "--mode", mode, "--out", str(path)],
            cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        runs[mode] = json.loads(path.read_text())
        print(json.dumps(runs[mode]), flush=True)
    result = {"machine": machine(), "load_average_start": started_load, "load_average_end": load(), "runs": runs}
    out.write_text(json.dumps(result, indent=2))
    return result


LOOP_FIGURES = {
    "rm_accuracy": "train_reward_model/eval_accuracy",
    "rm_pairs": "train_reward_model/pairs",
    "rm_eval_pairs": "train_reward_model/eval_pairs",
    "decisive_fraction": "collect_preferences/decisive_fraction",
    "rm_score": "evaluate/reward_mean",
    "initial_rm_score": "evaluate/reference_reward_mean",
    "rubric": "evaluate/rubric_mean",
    "initial_rubric": "evaluate/reference_rubric_mean",
    "kl_to_reference": "evaluate/kl_to_reference",
    "explained_variance": "ppo_update/explained_variance",
    "length_correlation": "rollout/score_length_correlation",
    "response_length": "rollout/response_length_mean",
}
"""The loop's curve: figure -> the MLflow metric of an iteration run it is read from."""


def iteration_figures(run_root: Path, campaign: str, named: dict[str, str], stages: tuple[str, ...]) -> list[dict]:
    """Per finished iteration of ``campaign``: its ``named`` metrics (figure -> MLflow metric), each of ``stages``'
    seconds and the iteration's wall seconds, from MLflow."""
    from storage.tracking import TAG_ITERATION

    rows = []
    for run in finished_iterations(run_root, campaign):
        metrics = run.data.metrics
        row = {"iteration": int(run.data.tags[TAG_ITERATION]), **{k: metrics.get(v) for k, v in named.items()}}
        row["seconds"] = {stage: metrics.get(f"{stage}/seconds") for stage in stages}
        row["wall_seconds"] = ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000
        row["run_id"] = run.info.run_id
        rows.append(row)
    return rows


def iteration_rows(run_root: Path, settings: list[str]) -> list[dict]:
    """Per finished iteration of the loop's campaign (the config's, or a ``campaign=`` setting's): the curve's figures
    and each stage's seconds, from MLflow."""
    from campaign.config import parse_override

    named = [value for key, value in map(parse_override, settings) if key == "campaign"]
    return iteration_figures(run_root, named[-1] if named else CAMPAIGN, LOOP_FIGURES, STAGES)


def _overrides(policy: Path, run_root: Path, iterations: int | None, settings: list[str]) -> list[str]:
    """The ``--set`` overrides of a bench run of a campaign: the converted model, the run root, the iterations."""
    overrides = [f"model.policy={policy}", f"run_root={run_root}"]
    return overrides + ([f"iterations={iterations}"] if iterations is not None else []) + settings


def run_campaign(config: Path, run_root: Path, overrides: list[str], *, fresh: bool = True) -> float:
    """``rlhf run --config config`` with ``overrides`` on a fresh ``run_root`` (the task's module beside its config), or
    on the run root of a stopped run (``fresh`` False: the campaign goes on where it stopped); its wall seconds."""
    if fresh:
        shutil.rmtree(run_root, ignore_errors=True)
    command = [str(REPO / ".venv" / "bin" / "rlhf"), "run", "--config", str(config)]
    command += [part for override in overrides for part in ("--set", override)]
    print(" ".join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "configs"), str(REPO)])}
    tick = time.perf_counter()
    if code := subprocess.run(command, cwd=REPO, env=env).returncode:
        raise SystemExit(code)  # the campaign said why, in one line
    return time.perf_counter() - tick


def _record(started_load: str, wall: float | None, run_root: Path, settings: list[str], **figures: object) -> dict:
    """What a curve's JSON holds: the machine, its load, the command's seconds, where and how it ran, its figures."""
    return {
        "machine": machine(),
        "load_average_start": started_load,
        "load_average_end": load(),
        "command_wall_seconds": wall,
        "run_root": str(run_root),
        "settings": settings,
        **figures,
    }


def loop_part(
    out: Path,
    *,
    iterations: int | None,
    read_back: Path | None,
    settings: list[str],
    run_root: Path | None,
    resume: bool = False,
) -> dict:
    run_root = read_back or run_root or SCRATCH / "real-loop-curve"
    started_load, wall = load(), None
    if read_back is None:
        overrides = _overrides(ensure_folder(), run_root, iterations, settings)
        wall = run_campaign(CONFIG, run_root, overrides, fresh=not resume)
    rows = iteration_rows(run_root, settings)
    figure = None
    if rows:
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
        figure = client.download_artifacts(rows[-1]["run_id"], "overoptimisation.png", str(SCRATCH))
    result = _record(started_load, wall, run_root, settings, figure=figure, iterations=rows, resumed=resume)
    out.write_text(json.dumps(result, indent=2))
    print(loop_section(result), flush=True)
    return result


EPISODES_CONFIG = REPO / "configs" / "smollm2-episodes.yaml"
EPISODES_CAMPAIGN = "smollm2-one-word-episodes"
EPISODE_FIGURES = ("success_by_turn_1", "success_by_turn_2", "success", "recovery", "turns_mean", "reward_mean")
"""The figures of a side of episodes (:func:`tasks.episode_evaluation.side_metrics`) the curve shows."""


def finished_iterations(run_root: Path, campaign: str) -> list:
    """The finished iteration runs of ``campaign`` in MLflow, in order."""
    from mlflow import MlflowClient

    from storage.tracking import KIND_ITERATION, TAG_ITERATION, TAG_KIND

    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(campaign)
    finished = f"tags.`{TAG_KIND}` = '{KIND_ITERATION}' and attributes.status = 'FINISHED'"
    runs = client.search_runs([experiment.experiment_id], finished)
    return sorted(runs, key=lambda run: int(run.data.tags[TAG_ITERATION]))


def rollout_figures(output: Path, *, max_turns: int) -> dict[str, float]:
    """A rollout's episodes (training prompts, the policy before the update) measured as evaluation measures a side
    (:func:`tasks.episode_evaluation.side_metrics`), from its ``turns`` table."""
    from storage.shards import read_table
    from tasks.episode_evaluation import side_metrics

    episodes: dict[int, tuple[list[float], list[str]]] = {}
    for turn in read_table(output, "turns").to_pylist():
        rewards, reasons = episodes.setdefault(turn["row"], ([], []))
        if turn["role"] == "assistant":
            rewards.append(turn["turn_reward"])
        if turn["stop_reason"] is not None:
            reasons.append(turn["stop_reason"])
    rewards, reasons = zip(*((r, s[-1]) for r, s in episodes.values()), strict=True)
    return side_metrics(list(rewards), list(reasons), max_turns=max_turns) | {"episodes": len(rewards)}


def episodes_part(out: Path, *, iterations: int | None, read_back: Path | None, settings: list[str]) -> dict:
    """``rlhf run --config configs/smollm2-episodes.yaml``; per iteration, the campaign's own evaluation of the
    updated policy and of the initial policy on held-out episodes (MLflow, ``evaluate/...``), and the figures of the
    iteration's rollout."""
    from storage.layout import RunLayout
    from storage.tracking import TAG_ITERATION

    run_root = read_back or SCRATCH / "real-loop-episodes"
    started_load, wall = load(), None
    if read_back is None:
        wall = run_campaign(EPISODES_CONFIG, run_root, _overrides(ensure_folder(), run_root, iterations, settings))
    layout = RunLayout(root=run_root / EPISODES_CAMPAIGN)
    rollouts = sorted(layout.stage_outputs("rollout"), key=lambda path: (path / "_manifest.json").stat().st_mtime)
    rows = []
    for run, rollout in zip(finished_iterations(run_root, EPISODES_CAMPAIGN), rollouts, strict=False):
        metrics = run.data.metrics
        rows.append(
            {
                "iteration": int(run.data.tags[TAG_ITERATION]),
                "held_out": {name: metrics.get(f"evaluate/{name}") for name in EPISODE_FIGURES},
                "initial": {name: metrics.get(f"evaluate/reference_{name}") for name in EPISODE_FIGURES},
                "rollout": rollout_figures(rollout, max_turns=3),
                "seconds": {stage: metrics.get(f"{stage}/seconds") for stage in ("rollout", "ppo_update", "evaluate")},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = _record(started_load, wall, run_root, settings, iterations=rows)
    out.write_text(json.dumps(result, indent=2))
    print(episodes_section(result), flush=True)
    return result


def episodes_section(result: dict) -> str:
    """The episodes' curve as a table of bench/RESULTS.md: per iteration, the campaign's evaluation of the updated
    policy on held-out episodes against the initial policy's, and the figures of the iteration's own rollout."""
    facts = result["machine"]
    settings = " ".join(f"--set {setting}" for setting in result["settings"])
    names = ("turn 1", "by turn 2", "final", "recovery", "turns", "reward")

    def figures(row: dict, against: dict | None = None) -> str:
        return " | ".join(
            _figure(row.get(name), ".2f") + (f" ({_figure(against.get(name), '.2f')})" if against else "")
            for name in EPISODE_FIGURES
        )

    lines = [
        f"`.venv/bin/python -m bench.real_loop episodes {settings}`".replace(" `", "`") + f", commit "
        f"{facts['commit']}; load average {result['load_average_start']} at the start, {result['load_average_end']} "
        f"at the end; command {_figure(result['command_wall_seconds'], '.0f')} s. Held out: the campaign's evaluation "
        "(`evaluate/...`) of the policy the iteration's update made, the initial policy's in brackets, on the same "
        "environment seeds; rollout: the iteration's own training episodes, sampled by the policy before its update. "
        "Success by turn n: the share of episodes with a one-word reply by turn n; recovery: of the episodes whose "
        "first turn failed, the share that succeeded later.",
        "",
        "| iteration | " + " | ".join(f"held-out {name}" for name in names) + " | "
        + " | ".join(f"rollout {name}" for name in names) + " | rollout s | update s | evaluate s |",
        "| --- " * (4 + 2 * len(names)) + "|",
    ]  # fmt: skip
    for row in result["iterations"]:
        seconds = " | ".join(_figure(row["seconds"][stage], ".0f") for stage in ("rollout", "ppo_update", "evaluate"))
        lines.append(
            f"| {row['iteration']} | {figures(row['held_out'], row['initial'])} | {figures(row['rollout'])} | {seconds} |"
        )
    return "\n".join(lines) + "\n"


SFT_CONFIG, SFT_CAMPAIGN = REPO / "configs" / "smollm2-sft.yaml", "smollm2-one-word-sft"
GRPO_CONFIG, GRPO_CAMPAIGN = REPO / "configs" / "smollm2.yaml", "smollm2-one-word"
GRPO_STAGES = ("rollout", "ppo_update", "evaluate")
GRPO_FIGURES = {
    "rubric": "evaluate/reward_mean",  # the reward is the rubric
    "initial_rubric": "evaluate/reference_reward_mean",
    "kl_to_reference": "evaluate/kl_to_reference",
}


def sft_stage_figures(run_root: Path, campaign: str) -> dict:
    """The ``sft`` stage's run in MLflow: its steps, train loss, first and last step loss, seconds."""
    from mlflow import MlflowClient

    from storage.tracking import TAG_STAGE

    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(campaign)
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`{TAG_STAGE}` = 'sft'")
    curve = sorted(client.get_metric_history(run.info.run_id, "sft/train/loss"), key=lambda metric: metric.step)
    metrics = run.data.metrics
    return {
        "examples": metrics.get("sft/examples"),
        "optimizer_steps": metrics.get("sft/optimizer_steps"),
        "train_loss": metrics.get("sft/train_loss"),
        "first_step_loss": curve[0].value if curve else None,
        "last_step_loss": curve[-1].value if curve else None,
        "seconds": metrics.get("sft/seconds"),
    }


def sft_part(out: Path, *, iterations: int, read_back: Path | None, settings: list[str]) -> dict:
    """``rlhf run`` on configs/smollm2-sft.yaml (SFT, then ``iterations`` GRPO iterations) and on configs/smollm2.yaml
    (the same iterations from the pretrained model), each on a fresh run root, ``settings`` on both (``sft.*`` ones on
    the first only); their curves and the SFT stage's figures, from MLflow."""
    roots = {"sft": (read_back or SCRATCH / "real-loop-sft"), "grpo": None}
    roots["grpo"] = roots["sft"].with_name(roots["sft"].name + "-grpo")
    started_load, walls = load(), {}
    campaigns = {"sft": (SFT_CONFIG, SFT_CAMPAIGN), "grpo": (GRPO_CONFIG, GRPO_CAMPAIGN)}
    if read_back is None:
        folder = ensure_folder()
        for name, (config, _) in campaigns.items():
            mine = [item for item in settings if name == "sft" or not item.startswith("sft.")]  # GRPO alone: no sft
            walls[name] = run_campaign(config, roots[name], _overrides(folder, roots[name], iterations, mine))
    curves = {
        name: iteration_figures(roots[name], campaign, GRPO_FIGURES, GRPO_STAGES)
        for name, (_, campaign) in campaigns.items()
    }
    result = _record(
        started_load, walls.get("sft"), roots["sft"], settings, iterations=iterations, command_seconds=walls,
        sft=sft_stage_figures(roots["sft"], SFT_CAMPAIGN), curves=curves,
    )  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    print(sft_section(result), flush=True)
    return result


def sft_section(result: dict) -> str:
    """The SFT curve as a table of bench/RESULTS.md: the held-out rubric of the pretrained policy and of the SFT model
    (each campaign's initial policy), then after each GRPO iteration of either, with the KL to its initial policy."""
    facts, sft, curves = result["machine"], result["sft"], result["curves"]
    settings = "".join(f" --set {setting}" for setting in result["settings"])
    walls = " and ".join(
        f"{_figure(result['command_seconds'].get(name), '.0f')} s ({name})" for name in ("sft", "grpo")
    )
    lines = [
        f"`.venv/bin/python -m bench.real_loop sft --iterations {result['iterations']}{settings}`, commit "
        f"{facts['commit']}; load average {result['load_average_start']} at the start, {result['load_average_end']} "
        f"at the end; commands {walls}. SFT: {_figure(sft['optimizer_steps'], '.0f')} steps on "
        f"{_figure(sft['examples'], '.0f')} demonstrations in {_figure(sft['seconds'], '.0f')} s, step loss "
        f"{_figure(sft['first_step_loss'], '.2f')} at the first, {_figure(sft['last_step_loss'], '.2f')} at the last.",
        "",
        "| campaign | initial policy | rubric of the initial policy | "
        + " | ".join(f"iteration {row['iteration']}: rubric (KL)" for row in curves["sft"])
        + " | s per iteration |",
        "| --- " * (4 + len(curves["sft"])) + "|",
    ]
    for name, title, initial in (
        ("grpo", "`configs/smollm2.yaml`", "pretrained"), ("sft", "`configs/smollm2-sft.yaml`", "SFT model")
    ):  # fmt: skip
        rows = curves[name]
        points = " | ".join(
            f"{_figure(row['rubric'], '.3f')} ({_figure(row['kl_to_reference'], '.2f')})" for row in rows
        )
        seconds = ", ".join(f"{row['wall_seconds']:.0f}" for row in rows)
        first = _figure(rows[0]["initial_rubric"], ".3f") if rows else ""
        lines.append(f"| {title} | {initial} | {first} | {points} | {seconds} |")
    return "\n".join(lines) + "\n"


DPO_CONFIG, DPO_CAMPAIGN = REPO / "configs" / "smollm2-dpo.yaml", "smollm2-one-word-dpo"
DPO_STAGES = ("sample_candidates", "collect_preferences", "reference_logprobs", "dpo_update", "evaluate")
DPO_FIGURES = {
    "rubric": "evaluate/rubric_mean",
    "initial_rubric": "evaluate/reference_rubric_mean",
    "kl_to_reference": "evaluate/kl_to_reference",
    "decisive_fraction": "collect_preferences/decisive_fraction",
    "pairs": "dpo_update/pairs",
    "accuracy": "dpo_update/rewards/accuracies",
    "margin": "dpo_update/rewards/margins",
    "loss": "dpo_update/loss",
}


def dpo_part(out: Path, *, iterations: int | None, read_back: Path | None, settings: list[str]) -> dict:
    """``rlhf run --config configs/smollm2-dpo.yaml`` on a fresh run root; its curve from MLflow."""
    run_root = read_back or SCRATCH / "real-loop-dpo"
    started_load, wall = load(), None
    if read_back is None:
        wall = run_campaign(DPO_CONFIG, run_root, _overrides(ensure_folder(), run_root, iterations, settings))
    rows = iteration_figures(run_root, DPO_CAMPAIGN, DPO_FIGURES, DPO_STAGES)
    result = _record(started_load, wall, run_root, settings, iterations=rows, asked_iterations=iterations)
    out.write_text(json.dumps(result, indent=2))
    print(dpo_section(result), flush=True)
    return result


def dpo_section(result: dict) -> str:
    """The DPO curve as a table of bench/RESULTS.md: per iteration, the held-out rubric against the initial policy's,
    the KL to the reference, the update's pairs and its TRL metrics on them after it, seconds per stage."""
    facts = result["machine"]
    asked = result.get("asked_iterations")
    settings = (f" --iterations {asked}" if asked else "") + "".join(f" --set {item}" for item in result["settings"])
    lines = [
        f"`.venv/bin/python -m bench.real_loop dpo{settings}`, commit {facts['commit']}; load average "
        f"{result['load_average_start']} at the start, {result['load_average_end']} at the end; command "
        f"{_figure(result['command_wall_seconds'], '.0f')} s.",
        "",
    ]
    columns = {
        "rubric (initial)": lambda row: _against(row, "rubric", ".3f"),
        "KL": lambda row: _figure(row["kl_to_reference"], ".2f"),
        "decisive share": lambda row: _figure(row["decisive_fraction"], ".2f"),
        "pairs": lambda row: _figure(row["pairs"], ".0f"),
        "accuracy": lambda row: _figure(row["accuracy"], ".2f"),
        "margin": lambda row: _figure(row["margin"], ".2f"),
        "loss": lambda row: _figure(row["loss"], ".3f"),
    }
    lines += _curve_table(result["iterations"], columns, DPO_STAGES)
    return "\n".join(lines) + "\n"


def _figure(value: float | None, form: str) -> str:
    return "" if value is None else format(value, form)


def _against(row: dict, name: str, form: str) -> str:
    """A figure of ``row`` with the initial policy's (``initial_<name>``) in brackets."""
    return f"{_figure(row[name], form)} ({_figure(row[f'initial_{name}'], form)})"


def _curve_table(rows: list[dict], columns: dict, stages: tuple[str, ...]) -> list[str]:
    """A curve's markdown table: per iteration row, its ``columns`` (title -> the cell of a row), each of ``stages``'
    seconds and the iteration's wall seconds."""
    lines = [
        "| iteration | " + " | ".join(columns) + " | " + " | ".join(stages) + " | iteration s |",
        "| --- " * (2 + len(columns) + len(stages)) + "|",
    ]
    for row in rows:
        cells = [cell(row) for cell in columns.values()] + [_figure(row["seconds"][stage], ".0f") for stage in stages]
        lines.append(f"| {row['iteration']} | " + " | ".join(cells) + f" | {row['wall_seconds']:.0f} |")
    return lines


def loop_section(result: dict) -> str:
    """The curve as a table of bench/RESULTS.md: per iteration, the reward model's held-out accuracy and share of
    decisive pairs, the policy's rubric and reward-model scores on held-out prompts against the initial policy's, the
    KL to the reference, the critic's explained variance, the reward's length correlation and seconds per stage."""
    facts = result["machine"]
    settings = " ".join(f"--set {setting}" for setting in result["settings"])
    settings += " --resume" if result.get("resumed") else ""  # the command's seconds are then the resumed part's
    lines = [
        f"`.venv/bin/python -m bench.real_loop loop {settings}`".replace("  ", " ") + f", commit {facts['commit']}; "
        f"load average {result['load_average_start']} at the start, {result['load_average_end']} at the end; "
        f"command {_figure(result['command_wall_seconds'], '.0f')} s.",
        "",
    ]
    columns = {
        "RM held-out accuracy": lambda row: _figure(row["rm_accuracy"], ".2f"),
        "decisive pairs": lambda row: _figure(row["decisive_fraction"], ".2f"),
        "rubric (initial)": lambda row: _against(row, "rubric", ".3f"),
        "RM score (initial)": lambda row: _against(row, "rm_score", ".2f"),
        "KL": lambda row: _figure(row["kl_to_reference"], ".2f"),
        "explained variance": lambda row: _figure(row["explained_variance"], ".2f"),
        "length correlation": lambda row: _figure(row["length_correlation"], ".2f"),
    }
    lines += _curve_table(result["iterations"], columns, STAGES)
    return "\n".join(lines) + "\n"


def choices_section(pairs: dict | None, critic: dict | None, lora: dict | None) -> str:
    """The choices measured one by one (``pairs``, ``critic``, ``lora``) as tables of bench/RESULTS.md."""
    lines = []
    if pairs:
        lines += [
            f"`.venv/bin/python -m bench.real_loop pairs`, commit {pairs['machine']['commit']}; load average "
            f"{pairs['load_average_start']} at the start, {pairs['load_average_end']} at the end. "
            f"{pairs['candidates_sampled']} candidates sampled once ({pairs['seconds_per_candidate']:.2f} s each); "
            f"every set is 128 of them; accuracy on {pairs['held_out_pairs']} decisive held-out pairs.",
            "",
            "| pair set | pairs | decisive | sampling s | training s | held-out accuracy | held-out loss | train accuracy |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, row in pairs["sets"].items():
            lines.append(
                f"| {name} | {row['pairs']} | {row['decisive_fraction']:.2f} | {row['sampling_seconds']:.0f} | "
                f"{row['training_seconds']:.0f} | {row['eval_accuracy']:.3f} | {row['eval_loss']:.3f} | "
                f"{row['train_accuracy']:.3f} |"
            )
        lines.append("")
    if critic:
        steps = sorted({int(step) for row in critic["critics"].values() for step in row["explained_variance"]})
        lines += [
            f"`.venv/bin/python -m bench.real_loop critic`, commit {critic['machine']['commit']}; load average "
            f"{critic['load_average_start']} at the start, {critic['load_average_end']} at the end. The returns of "
            f"{critic['rollouts'][0]} rollouts scored by the `{critic['reward_model']}` reward model; explained "
            f"variance on {critic['rollouts'][1]} others after each number of value steps.",
            "",
            "| critic from | " + " | ".join(f"EV after {step}" for step in steps) + " | s per step |",
            "| --- | " + " | ".join("---" for _ in steps) + " | --- |",
        ]
        for name, row in critic["critics"].items():
            curve = row["explained_variance"]
            lines.append(
                f"| {name} | " + " | ".join(f"{curve[str(step)]:.3f}" for step in steps)
                + f" | {row['seconds_per_step']:.1f} |"
            )  # fmt: skip
        lines.append("")
    if lora:
        lines += [
            f"`.venv/bin/python -m bench.real_loop lora`, commit {lora['machine']['commit']}; load average "
            f"{lora['load_average_start']} at the start, {lora['load_average_end']} at the end; each mode in a "
            "process of its own, one thread.",
            "",
            "| mode | trained parameters | load s | rollout s (CPU) | update s (CPU) | save s | written MiB | peak RSS MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, run in lora["runs"].items():
            lines.append(
                f"| {mode} | {run['trained_parameters'] / 1e6:.1f} M | {run['load_seconds']:.1f} | "
                f"{run['rollout_wall_cpu'][0]:.1f} ({run['rollout_wall_cpu'][1]:.1f}) | "
                f"{run['update_wall_cpu'][0]:.1f} ({run['update_wall_cpu'][1]:.1f}) | {run['save_seconds']:.1f} | "
                f"{run['written_bytes'] / 2**20:.0f} | {run['peak_rss_mib']:.0f} |"
            )
    return "\n".join(lines) + "\n"


PARTS = ("pairs", "pairs-file", "critic", "critic-start", "lora", "lora-worker", "loop", "choices", "decisive", "episodes", "sft", "dpo")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--prompts", type=int, default=96, help="pairs-file: training prompts, 4 candidates each")
    parser.add_argument("--mode", choices=["full", "lora"], help="lora-worker: which")
    parser.add_argument(
        "--iterations", type=int, help="loop, episodes, dpo: override the config's iterations (sft: each campaign's, 2)"
    )
    parser.add_argument(
        "--read-back", type=Path, help="loop, episodes, sft, dpo: read the run root of a stopped run instead of running"
    )
    parser.add_argument(
        "--set", action="append", default=[], help="loop, episodes, sft, dpo: a config override (KEY=VALUE), repeatable"
    )
    parser.add_argument(
        "--run-root", type=Path, help="loop: the (fresh) run root (default bench/.scratch/real-loop-curve)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="loop: go on with the run root of a stopped run (same --run-root and --set) instead of starting afresh",
    )
    parser.add_argument("--out", type=Path, help="the JSON written (default bench/.scratch/real-loop-PART.json)")
    args = parser.parse_args()
    out = args.out or SCRATCH / f"real-loop-{args.part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "configs"))  # the task's module, smollm2_task, beside its config
    random.seed(0)
    if args.part == "pairs":
        pairs_part(out)
    elif args.part == "pairs-file":
        pairs_file_part(args.prompts)
    elif args.part == "decisive":
        decisive_part(out)
    elif args.part == "episodes":
        episodes_part(out, iterations=args.iterations, read_back=args.read_back, settings=args.set)
    elif args.part == "sft":
        sft_part(out, iterations=args.iterations or 2, read_back=args.read_back, settings=args.set)
    elif args.part == "dpo":
        dpo_part(out, iterations=args.iterations, read_back=args.read_back, settings=args.set)
    elif args.part == "critic":
        critic_part(out)
    elif args.part == "critic-start":
        critic_start_part(out, args.read_back or SCRATCH / "real-loop-curve")
    elif args.part == "lora":
        lora_part(out)
    elif args.part == "lora-worker":
        lora_worker(args.mode, out)
    elif args.part == "choices":  # the three parts' tables, from their JSON files
        parts = {part: SCRATCH / f"real-loop-{part}.json" for part in ("pairs", "critic", "lora")}
        print(choices_section(**{k: json.loads(v.read_text()) if v.is_file() else None for k, v in parts.items()}))
    else:
        loop_part(
            out, iterations=args.iterations, read_back=args.read_back, settings=args.set, run_root=args.run_root,
            resume=args.resume,
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
