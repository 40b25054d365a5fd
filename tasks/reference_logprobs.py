"""The reference's log-probs of the pairs a DPO update trains on: computed once, kept beside the pairs' tokens.

Choices:
1. The pairs are the iteration's decisive ones: a pair a scoring labeler (``gold``, ``function``, ``reward_model``)
   tied (margin 0) says nothing about which response is better, and DPO would push one of them down for nothing (TRL
   takes every pair it is given; UltraFeedback's binarisation drops ties before). An imported or a person's pair is
   decisive whatever its margin (0 there means none was given); a person's ties were dropped already.
2. Each pair is rendered in the policy's tokens as the reward model's pairs are rendered in its own
   (:func:`tasks.text.response_id_lists`); the ids are stored, so the update trains on exactly the tokens the
   reference scored, and re-tokenises nothing.
3. The reference is the frozen initial policy (:meth:`rlhf_core.loading.ModelLoader.reference`), whatever policy
   the update starts from, so this output's key holds the pairs and the base, never the policy: a replay of the update
   with another ``dpo.beta`` or loss reads it back and runs no reference.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from rlhf_core.dpo import reference_logprobs as score_pairs
from rlhf_core.errors import UserError
from runtime.job import Job
from runtime.stage import Stage
from storage.schemas import (
    CHOSEN,
    CHOSEN_IDS,
    LABELER,
    MARGIN,
    PAIR_ID,
    PROMPT_IDS,
    REF_LOGPROBS,
    REFERENCE_LOGPROBS,
    REJECTED,
    REJECTED_IDS,
)
from storage.shards import read_table
from tasks.settings import ReferenceLogprobsSettings
from tasks.tensors import preference_pairs
from tasks.text import load_tokenizer, prompts_of, response_id_lists


class NoDecisivePair(UserError, ValueError):
    """An iteration's pairs are all ties: a DPO update has nothing to learn from (one line, exit code 2)."""


TYING_LABELERS = ("gold", "function", "reward_model")
"""Labelers whose margin 0 is a tie (choice 1)."""


def decisive(table: pa.Table) -> pa.Table:
    """The rows of a ``preferences`` table that say which response is better (choice 1)."""
    tie = pc.and_(pc.equal(table.column(MARGIN), 0.0), pc.is_in(table.column(LABELER), pa.array(TYING_LABELERS)))
    return table.filter(pc.invert(tie))


def work(job: Job[ReferenceLogprobsSettings]) -> dict[str, float]:
    """Write the :data:`storage.schemas.REFERENCE_LOGPROBS` table of the decisive pairs."""
    settings, context = job.settings, job.context
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    every = pa.concat_tables([read_table(result.directory, "preferences") for result in settings.preferences])
    table = decisive(every)
    if table.num_rows == 0:
        raise NoDecisivePair(
            f"reference_logprobs: none of the {every.num_rows} pairs is decisive (every one a tie), so the DPO update "
            "has nothing to learn from; raise `sizes.preference_prompts` or `sizes.candidates_per_prompt`"
        )
    prompts = prompts_of(table)
    prompt_lists, chosen_lists = response_id_lists(tokenizer, prompts, table.column(CHOSEN).to_pylist())
    _, rejected_lists = response_id_lists(tokenizer, prompts, table.column(REJECTED).to_pylist())
    pairs = preference_pairs(prompt_lists, chosen_lists, rejected_lists, pad_token_id=tokenizer.pad_token_id)
    with models.autocast():
        chosen, rejected = score_pairs(models.reference(), pairs.to(models.device), batch_size=settings.batch_size)
    columns = {
        PAIR_ID: table.column(PAIR_ID),
        PROMPT_IDS: prompt_lists,
        CHOSEN_IDS: chosen_lists,
        REJECTED_IDS: rejected_lists,
        f"{REF_LOGPROBS}_{CHOSEN}": chosen.total.cpu().tolist(),
        f"{REF_LOGPROBS}_{REJECTED}": rejected.total.cpu().tolist(),
        f"{REF_LOGPROBS}_{CHOSEN}_mean": chosen.mean.cpu().tolist(),
        f"{REF_LOGPROBS}_{REJECTED}_mean": rejected.mean.cpu().tolist(),
        f"{CHOSEN}_tokens": [len(ids) for ids in chosen_lists],
        f"{REJECTED}_tokens": [len(ids) for ids in rejected_lists],
    }
    output = pa.table(columns, schema=REFERENCE_LOGPROBS)
    job.out.write_table("reference_logprobs", output, schema=REFERENCE_LOGPROBS, rows_per_shard=settings.rows_per_shard)
    return {
        "pairs": float(table.num_rows),
        "ties_dropped": float(every.num_rows - table.num_rows),
        "logps/chosen": chosen.total.mean().item(),
        "logps/rejected": rejected.total.mean().item(),
    }


reference_logprobs = Stage(ReferenceLogprobsSettings, work=work)
