"""Stage 7, evaluate: the policy against the frozen initial policy (the reference) on held-out prompts.

Reports the reward's score of both (the reward model's, or the reward function's; none in a campaign without a reward, a
DPO update's), the KL to the reference (mean over responses of the
summed per-token k1 estimate; :func:`rlhf_core.evaluation.response_kl`) and, where a gold judge
applies, the gold score of both and the policy's gold win rate against the reference (ties count
half; :func:`rlhf_core.evaluation.win_rate`). The reference's side was sampled once for the campaign
(:mod:`tasks.sample_reference`) and is read back; the policy samples each prompt with the seed the reference sampled it
with (on vLLM, the same per-row seeds: :mod:`tasks.sampler`), the same in every iteration, and the iteration's reward
scores both sides. The prompts are split into shards (:mod:`runtime.fanout`) wherever ``execution.task_runner`` runs
them. On vLLM the KL uses the actor's own log-probs of the engine's tokens, and the stage records the engine's
mismatch to them.
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
from storage.schemas import (
    ENGINE_LOGPROBS,
    EVALUATION,
    LOGPROB_COLUMNS,
    OLD_LOGPROBS,
    POLICY_KL,
    PROMPT,
    RESPONSE,
    RESPONSE_IDS,
    SAMPLES,
)
from storage.shards import read_table
from tasks import episode_evaluation
from tasks.episodes import not_resumable
from tasks.held_out import batch_generator, held_out_shards
from tasks.reward_function import score_texts
from tasks.sampler import mismatch_metrics, policy_sampler, row_seeds, sample_whole_shard
from tasks.settings import EvaluateSettings
from tasks.tensors import encode_prompts, pad_token_lists, response_token_lists, reward_scorer
from tasks.text import Prompt, decode, load_tokenizer, prompt_text, read_prompts

SIDES = ("policy", "reference")


def plan(job: Job[EvaluateSettings]) -> Shards:
    """The held-out prompts in shards, seeded as the reference's were (:func:`tasks.held_out.held_out_shards`)."""
    settings = job.settings
    rewards = sum(
        reward is not None for reward in (settings.reward_model, settings.reward_function, settings.environment)
    )
    if rewards != int(settings.rewarded):
        raise ValueError(
            "evaluate needs exactly one reward, a reward model, a reward function or an environment, and none in a "
            "campaign without a reward (a DPO update's)"
        )
    table = "evaluation" if settings.environment is None else "episode_evaluation"
    shards = held_out_shards(job, settings.prompts, rows_per_shard=settings.rows_per_shard)
    return Shards(shards, table, not_resumable=not_resumable(settings.environment))


def work(job: Job[EvaluateSettings]) -> Iterator[pa.Table]:
    """The :data:`storage.schemas.EVALUATION` rows of each shard of the held-out prompts.

    The policy samples each batch with the generator the reference sampled it with (:mod:`tasks.sample_reference`);
    the reference's responses are read back and scored by this iteration's reward, in the layout the policy's are.
    With an environment, held-out episodes (:mod:`tasks.episode_evaluation`).
    """
    settings, context = job.settings, job.context
    if settings.environment is not None:
        yield from episode_evaluation.evaluate_work(job)
        return
    sampling, reward_model, reward_function = settings.sampling, settings.reward_model, settings.reward_function
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", settings.policy.directory / "actor")
    sides = {"policy": actor, "reference": models.reference(actor)}
    sampler = policy_sampler(models, context, settings.policy.directory / "actor", actor, sampling)
    scorer = None
    if reward_model is not None:
        scorer = reward_scorer(
            models.load("reward_model", reward_model.directory / "reward_model"),
            policy_tokenizer_dir=context.base.tokenizer.path,
            reward_tokenizer_dir=context.base.reward_tokenizer,
        )
    function = None if reward_function is None else reward_function.load()
    held_out = read_prompts(settings.eval_prompts.path)[: settings.prompts]
    texts = [prompt_text(tokenizer, prompt) for prompt in held_out]
    reference = read_table(settings.reference.directory, "reference_responses")
    reference_ids, reference_texts = reference.column(RESPONSE_IDS).to_pylist(), reference.column(RESPONSE).to_pylist()

    def score(
        part: slice, sequences: torch.Tensor, attention_mask: torch.Tensor, responses: list[str], prompt_length: int
    ) -> list[float | None]:
        """The reward of each of ``responses`` to the prompts ``part`` (their tokens from ``prompt_length`` on); None
        for each without a reward (a DPO update's campaign).

        Shapes: sequences, attention_mask: (b, P + R), ``[left-padded prompt | right-padded response]``.
        """
        if scorer is None and function is None:
            return [None] * len(responses)
        if scorer is not None:
            return scorer.score(held_out[part], sequences, attention_mask, prompt_length=prompt_length).cpu().tolist()
        ids = range(part.start, part.stop)  # held-out prompts are named by their line in the file
        scores = score_texts(function, reward_function.name, held_out[part], responses, ids, prompt_texts=texts[part])
        return scores.cpu().tolist()

    for shard in job.shards:
        rows: dict[str, list] = {name: [] for name in EVALUATION.names}
        seeds = row_seeds(sampling, shard, shard.start, shard.stop - shard.start)
        sample_whole_shard(sampler, tokenizer, held_out[shard.start : shard.stop], seeds=seeds, sampling=sampling)
        for part in shard.batches(sampling.batch_size):
            prompt_ids, prompt_mask = encode_prompts(tokenizer, held_out[part])
            prompt_ids, prompt_mask = prompt_ids.to(models.device), prompt_mask.to(models.device)
            prompt_length = prompt_ids.shape[1]  # P: where every response of the batch starts, on both sides
            with models.autocast(), torch.no_grad():
                generation = generate(
                    sampler,
                    prompt_ids,
                    prompt_mask,
                    config=sampling,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    generator=batch_generator(shard, part),
                    seeds=row_seeds(sampling, shard, part.start, prompt_ids.shape[0]),
                )
                responses = decode(tokenizer, response_token_lists(generation.sequences, generation.action_mask))
                scores = score(part, generation.sequences, generation.attention_mask, responses, prompt_length)
                # The reference's responses to the same prompts, in the layout the policy's came in.
                answers, answer_mask = pad_token_lists(reference_ids[part], pad_token_id=tokenizer.pad_token_id)
                answers, answer_mask = answers.to(models.device), answer_mask.to(models.device)
                reference_scores = score(
                    part,
                    torch.cat([prompt_ids, answers], dim=1),  # (b, P + R')
                    torch.cat([prompt_mask, answer_mask], dim=1),  # (b, P + R')
                    reference_texts[part],
                    prompt_length,
                )
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
            rows[PROMPT].extend(texts[part])  # as the model saw it: a chat prompt through its template
            rows["policy_response"].extend(responses)
            rows["policy_reward"].extend(scores)
            rows["reference_response"].extend(reference_texts[part])
            rows["reference_reward"].extend(reference_scores)
            rows[POLICY_KL].extend(kl.cpu().tolist())
            mask = generation.action_mask.cpu()
            for name, values in ((OLD_LOGPROBS, policy_logprobs), (ENGINE_LOGPROBS, generation.logprobs)):
                kept = [row[keep].tolist() for row, keep in zip(values.cpu(), mask, strict=True)]
                rows[name].extend(kept if sampler is not actor else [None] * len(kept))
        yield pa.table(rows, schema=EVALUATION)


def gather(job: Job[EvaluateSettings], table: pa.Table) -> dict[str, float]:
    """Write ``samples.jsonl`` (prompt, both responses and their scores) and return the evaluation metrics (held-out
    episodes' with an environment: :func:`tasks.episode_evaluation.evaluate_gather`)."""
    settings = job.settings
    if settings.environment is not None:
        return episode_evaluation.evaluate_gather(job, table)
    metrics = {"kl_to_reference": _mean(table, POLICY_KL), **mismatch_metrics(table)}
    if not table.column("policy_reward").null_count:  # a campaign without a reward (a DPO update's) has none
        metrics |= {
            "reward_mean": _mean(table, "policy_reward"),
            "reference_reward_mean": _mean(table, "reference_reward"),
        }
    records = table.drop_columns(list(LOGPROB_COLUMNS)).to_pylist()
    if settings.judge is not None:
        metrics.update(_gold_metrics(records, settings.judge))
    if settings.rubric is not None:
        held_out = read_prompts(settings.eval_prompts.path)[: settings.prompts]
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
