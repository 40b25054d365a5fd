"""Stage 7, evaluate: the policy against the frozen initial policy (the reference) on held-out prompts.

Reports the reward's score of both (the reward model's, or the reward function's), the KL to the reference (mean over responses of the
summed per-token k1 estimate; :func:`rlhf_core.evaluation.response_kl`) and, where a gold judge
applies, the gold score of both and the policy's gold win rate against the reference (ties count
half; :func:`rlhf_core.evaluation.win_rate`). Both policies sample each prompt with the same seed (on vLLM, the
same per-row seeds: :mod:`tasks.sampler`). The prompts are split into shards (:mod:`runtime.fanout`) wherever
``execution.task_runner`` runs them. On vLLM the KL uses the actor's own log-probs of the engine's tokens, and the
stage records the engine's mismatch to them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa
import torch

from rlhf_core.evaluation import response_kl, win_rate
from rlhf_core.generation import generate
from rlhf_core.sequences import sequence_logprobs
from runtime.job import Job
from runtime.references import JudgeReference, RewardFunctionReference
from runtime.stage import Shards, Stage
from storage.schemas import ENGINE_LOGPROBS, EVALUATION, LOGPROB_COLUMNS, OLD_LOGPROBS, POLICY_KL, PROMPT, SAMPLES
from tasks.reward_function import score_texts
from tasks.sampler import mismatch_metrics, policy_sampler, row_seeds
from tasks.settings import EvaluateSettings
from tasks.tensors import encode_prompts, response_token_lists, reward_scorer
from tasks.text import Prompt, decode, load_tokenizer, prompt_text, read_prompts

SIDES = ("policy", "reference")


def plan(job: Job[EvaluateSettings]) -> Shards:
    """The held-out prompts in shards."""
    settings = job.settings
    if (settings.reward_model is None) == (settings.reward_function is None):
        raise ValueError("evaluate needs exactly one reward: a reward model or a reward function")
    return Shards(
        job.plan_shards(settings.prompts, rows_per_item=1, rows_per_shard=settings.rows_per_shard), "evaluation"
    )


def work(job: Job[EvaluateSettings]) -> Iterator[pa.Table]:
    """The :data:`storage.schemas.EVALUATION` rows of each shard of the held-out prompts.

    Both sides sample a batch with the same generator seed (the shard's seed plus the batch's first prompt). Each side
    samples the whole shard before the other (on vLLM, one weight swap per side and shard, not two per batch).
    """
    settings, context = job.settings, job.context
    sampling, reward_model, reward_function = settings.sampling, settings.reward_model, settings.reward_function
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", settings.policy.directory / "actor")
    sides = {"policy": actor, "reference": models.reference(actor)}
    samplers = {
        "policy": policy_sampler(models, context, settings.policy.directory / "actor", actor, sampling),
        "reference": policy_sampler(models, context, context.base.policy.path, sides["reference"], sampling),
    }
    scorer = None
    if reward_model is not None:
        scorer = reward_scorer(
            models.load("reward_model", reward_model.directory / "reward_model"),
            policy_tokenizer_dir=context.base.tokenizer.path,
            reward_tokenizer_dir=context.base.reward_tokenizer,
        )
    function = None if reward_function is None else reward_function.load()
    held_out = read_prompts(context.base.eval_prompts.path)[: settings.prompts]
    texts = [prompt_text(tokenizer, prompt) for prompt in held_out]
    for shard in job.shards:
        rows: dict[str, list] = {name: [] for name in EVALUATION.names}
        for side, sampler in samplers.items():  # each side over the whole shard: one weight swap per side and shard
            for part in shard.batches(sampling.batch_size):
                prompt_ids, prompt_mask = encode_prompts(tokenizer, held_out[part])
                prompt_ids, prompt_mask = prompt_ids.to(models.device), prompt_mask.to(models.device)
                with models.autocast(), torch.no_grad():
                    generation = generate(
                        sampler,
                        prompt_ids,
                        prompt_mask,
                        config=sampling,
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id,
                        generator=torch.Generator().manual_seed(shard.seed + part.start),
                        seeds=row_seeds(sampling, shard, part.start, prompt_ids.shape[0]),
                    )
                    responses = decode(tokenizer, response_token_lists(generation.sequences, generation.action_mask))
                    if scorer is not None:
                        scores = scorer.score(
                            held_out[part],
                            generation.sequences,
                            generation.attention_mask,
                            prompt_length=prompt_ids.shape[1],
                        )
                    else:  # held-out prompts are named by their line in the file
                        ids = range(part.start, part.stop)
                        scores = score_texts(
                            function, reward_function.name, held_out[part], responses, ids, prompt_texts=texts[part]
                        )
                    rows[f"{side}_response"].extend(responses)
                    rows[f"{side}_reward"].extend(scores.cpu().tolist())
                    if side == "policy":
                        logprobs = {
                            name: sequence_logprobs(
                                sides[name],
                                generation.sequences,
                                generation.attention_mask,
                                prompt_ids.shape[1],
                                temperature=sampling.temperature,
                            )
                            for name in (("reference",) if sampler is actor else SIDES)
                        }
                        policy_logprobs = logprobs.get("policy", generation.logprobs)
                        kl = response_kl(policy_logprobs, logprobs["reference"], generation.action_mask)
                        rows[POLICY_KL].extend(kl.cpu().tolist())
                        mask = generation.action_mask.cpu()
                        for name, values in ((OLD_LOGPROBS, policy_logprobs), (ENGINE_LOGPROBS, generation.logprobs)):
                            kept = [row[keep].tolist() for row, keep in zip(values.cpu(), mask, strict=True)]
                            rows[name].extend(kept if sampler is not actor else [None] * len(kept))
                if side == "policy":  # as the model saw it: a chat prompt through its template
                    rows[PROMPT].extend(texts[part])
        yield pa.table(rows, schema=EVALUATION)


def gather(job: Job[EvaluateSettings], table: pa.Table) -> dict[str, float]:
    """Write ``samples.jsonl`` (prompt, both responses and their scores) and return the evaluation metrics."""
    settings = job.settings
    metrics = {
        "reward_mean": _mean(table, "policy_reward"),
        "reference_reward_mean": _mean(table, "reference_reward"),
        "kl_to_reference": _mean(table, POLICY_KL),
        **mismatch_metrics(table),
    }
    records = table.drop_columns(list(LOGPROB_COLUMNS)).to_pylist()
    if settings.judge is not None:
        metrics.update(_gold_metrics(records, settings.judge))
    if settings.rubric is not None:
        held_out = read_prompts(job.context.base.eval_prompts.path)[: settings.prompts]
        metrics.update(_rubric_metrics(records, held_out, settings.rubric))
    (job.out.path / SAMPLES).write_text("".join(json.dumps(record) + "\n" for record in records))
    return metrics


def _mean(table: pa.Table, column: str) -> float:
    return float(torch.tensor(table.column(column).to_pylist(), dtype=torch.float64).mean())


def _rubric_metrics(records: list[dict], held_out: list[Prompt], rubric: RewardFunctionReference) -> dict[str, float]:
    """The rubric's mean score of both sides (``held_out``: each record's prompt); adds ``<side>_rubric`` to each
    record."""
    function, texts = rubric.load(), [record[PROMPT] for record in records]
    metrics = {}
    for side, name in (("policy", "rubric_mean"), ("reference", "reference_rubric_mean")):
        responses = [record[f"{side}_response"] for record in records]
        ids = range(len(records))
        scores = score_texts(function, rubric.name, held_out, responses, ids, prompt_texts=texts).tolist()
        for record, score in zip(records, scores, strict=True):
            record[f"{side}_rubric"] = score
        metrics[name] = sum(scores) / max(len(scores), 1)
    return metrics


def _gold_metrics(records: list[dict], judge_reference: JudgeReference) -> dict[str, float]:
    """Gold scores of both sides and the policy's gold win rate; adds ``<side>_gold`` to each record."""
    judge = judge_reference.load()
    for record in records:
        for side in SIDES:
            record[f"{side}_gold"] = judge.score(record["prompt"], record[f"{side}_response"])
    gold = {side: torch.tensor([record[f"{side}_gold"] for record in records], dtype=torch.float64) for side in SIDES}
    return {
        "gold_mean": float(gold["policy"].mean()),
        "reference_gold_mean": float(gold["reference"].mean()),
        "gold_win_rate": float(win_rate(gold["policy"], gold["reference"])),
    }


evaluate = Stage(EvaluateSettings, plan=plan, work=work, gather=gather)
