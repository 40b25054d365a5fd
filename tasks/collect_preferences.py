"""Stage 2, collect preferences: label pairs of candidates (or import pairs from a file).

With labeler ``human`` the labels are a person's answers, asked for by the iteration flow before
this stage (:mod:`flows.human_labels`) and passed in as their own stage output, so they are part
of this stage's input key: the same answers reuse the output, other answers make a new one.

Labelling by a reward model splits the pairs into shards (:mod:`runtime.fanout`), wherever
``execution.task_runner`` runs them.

Which pairs of a prompt's candidates are compared and kept is the setting ``pairing`` (:mod:`tasks.pairing`):
consecutive candidates, or, with a labeler that scores each candidate (``function``, ``gold``), the best against a
worse one or every decisive pair. ``decisive_fraction`` is the share of the compared pairs that had a winner;
``decisive_pairs`` the pairs kept that have one (what ``sizes.decisive_pairs`` counts, :mod:`flows.rounds`), ``ties``
the compared pairs that had none.

A later round of the iteration's candidates (``sizes.decisive_pairs``) numbers its pairs after the earlier rounds'
(``earlier``), so a pair id names one pair across the whole campaign.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from itertools import groupby
from types import MappingProxyType
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from rlhf_core.config import Pairing
from runtime.declaration import StageResult
from runtime.job import Job, Shards
from runtime.stage import Stage
from storage.importers import import_preferences
from storage.manifest import read_manifest
from storage.schemas import CHOICE, PAIR_ID, PREFERENCES
from storage.shards import read_table
from tasks.labelers import (
    SKIP,
    CandidatePair,
    FunctionLabeler,
    HumanLabeler,
    JudgeLabeler,
    Label,
    Labeler,
    RewardModelLabeler,
)
from tasks.pairing import compared_pairs, kept_pairs
from tasks.settings import CollectPreferencesSettings
from tasks.tensors import reward_scorer
from tasks.text import Prompt, load_tokenizer, prompt_text, read_prompts

PAIRS_PER_ITERATION = 1_000_000
"""Pair ids of iteration N start at N times this: a pair's id names it across the whole campaign."""


class PromptPairs(NamedTuple):
    """The pairs of one prompt's candidates that the labeler compares: their candidate indices and the pairs."""

    compared: list[tuple[int, int]]
    pairs: list[CandidatePair]


def candidate_groups(
    candidates: pa.Table, *, columns: Sequence[Mapping[str, Any]] = (), pairing: Pairing = "consecutive"
) -> list[PromptPairs]:
    """The pairs of each prompt's candidates that the labeler compares (:func:`tasks.pairing.compared_pairs`), in
    prompt order.

    Args:
        columns: the other columns of each row of the prompts file, by ``prompt_id`` (the row), for a rubric that
            reads them (:mod:`tasks.reward_function`); empty: none.
        pairing: consecutive candidates, (0, 1), (2, 3), ..., or every pair of them.
    """
    rows = candidates.sort_by([("prompt_id", "ascending"), ("candidate_index", "ascending")]).to_pylist()
    groups = []
    for prompt_id, group in groupby(rows, key=lambda row: row["prompt_id"]):
        group = list(group)
        try:
            compared = compared_pairs(len(group), pairing)
        except ValueError as error:
            raise ValueError(f"prompt {prompt_id}: {error}") from None
        prompt = Prompt(
            group[0]["prompt"],
            tuple(group[0]["messages"]),
            MappingProxyType(dict(columns[prompt_id])) if columns else MappingProxyType({}),
        )
        pairs = [
            CandidatePair(
                prompt=prompt,
                first=group[first]["response"],
                second=group[second]["response"],
                first_ids=group[first]["prompt_ids"] + group[first]["response_ids"],
                second_ids=group[second]["prompt_ids"] + group[second]["response_ids"],
            )
            for first, second in compared
        ]
        groups.append(PromptPairs(compared, pairs))
    return groups


def candidate_pairs(candidates: pa.Table, *, columns: Sequence[Mapping[str, Any]] = ()) -> list[CandidatePair]:
    """Consecutive candidates of each prompt, (0, 1), (2, 3), ..., as pairs (:func:`candidate_groups`, flat)."""
    return [pair for group in candidate_groups(candidates, columns=columns) for pair in group.pairs]


def paired_table(
    groups: list[PromptPairs], labeler: Labeler, pairing: Pairing, *, seed: int, first_pair_id: int
) -> tuple[pa.Table, dict[str, float]]:
    """Label every compared pair of ``groups`` (:func:`candidate_groups`), keep those ``pairing`` keeps
    (:func:`tasks.pairing.kept_pairs`, its random draws seeded by ``seed``), and say how many it compared and
    how many of those had a winner.

    Returns:
        The ``preferences`` table, and the metrics ``compared_pairs``, ``decisive_fraction`` and ``ties``.
    """
    compared = [pair for group in groups for pair in group.pairs]
    labels = labeler.label(compared)
    rng, kept, start = random.Random(seed), [], 0
    for group in groups:
        answers = labels[start : start + len(group.pairs)]
        kept += [start + index for index in kept_pairs(group.compared, answers, pairing, rng=rng)]
        start += len(group.pairs)
    decisive = sum(label.margin > 0 for label in labels)
    table = pair_table([compared[i] for i in kept], [labels[i] for i in kept], labeler.name, first_pair_id)
    return table, {
        "compared_pairs": float(len(compared)),
        "decisive_fraction": decisive / max(len(compared), 1),
        "ties": float(len(compared) - decisive),
    }


def labelled_table(pairs: list[CandidatePair], labeler: Labeler, *, first_pair_id: int) -> pa.Table:
    return pair_table(pairs, labeler.label(pairs), labeler.name, first_pair_id)


def pair_table(pairs: list[CandidatePair], labels: list[Label], labeler: str, first_pair_id: int) -> pa.Table:
    """The ``preferences`` rows of labelled pairs: the winner chosen, the other rejected."""
    chosen = [pair.second if label.winner else pair.first for pair, label in zip(pairs, labels, strict=True)]
    rejected = [pair.first if label.winner else pair.second for pair, label in zip(pairs, labels, strict=True)]
    return pa.table(
        {
            "pair_id": list(range(first_pair_id, first_pair_id + len(pairs))),
            "prompt": [pair.prompt.text for pair in pairs],
            "messages": [list(pair.prompt.messages) for pair in pairs],
            "chosen": chosen,
            "rejected": rejected,
            "margin": [label.margin for label in labels],
            "labeler": [labeler] * len(pairs),
        },
        schema=PREFERENCES,
    )


def human_table(pairs: list[CandidatePair], answers: pa.Table, *, first_pair_id: int) -> pa.Table:
    """The preference table of a person's answers (a ``human_labels`` table); tie/skip pairs are dropped.

    Raises:
        ValueError: the answers are not exactly one per pair of these candidates.
    """
    choices = dict(zip(answers.column(PAIR_ID).to_pylist(), answers.column(CHOICE).to_pylist(), strict=True))
    if sorted(choices) != list(range(len(pairs))) or answers.num_rows != len(pairs):
        raise ValueError(f"the human labels hold {answers.num_rows} answers, not one for each of {len(pairs)} pairs")
    kept = [index for index in range(len(pairs)) if choices[index] != SKIP]
    labeler = HumanLabeler([choices[index] for index in kept])
    return labelled_table([pairs[index] for index in kept], labeler, first_pair_id=first_pair_id)


def plan(job: Job[CollectPreferencesSettings]) -> Shards | None:
    """Labelling by a reward model runs over shards of the candidate pairs; every other labeler labels here."""
    settings = job.settings
    if settings.labeler != "reward_model":
        return None
    if settings.reward_model is None and job.context.base.reward_model is None:
        raise ValueError("labeler 'reward_model' needs a reward model: a trained one, or `model.reward_model`")
    pairs = len(candidate_pairs(read_table(settings.candidates.directory, "candidates")))
    return Shards(job.plan_shards(pairs, rows_per_item=1, rows_per_shard=settings.rows_per_shard), "preferences")


def work(job: Job[CollectPreferencesSettings]) -> dict[str, float] | Iterator[pa.Table]:
    """The ``preferences`` rows of each shard of the candidate pairs, labelled by the reward model
    (:func:`label_shards`); with any other labeler, the whole ``preferences`` table written here, and its metrics.

    Labeler ``import`` reads its file in iteration 0 only; ``human`` takes the person's answers (a ``human_labels``
    output), dropping tie/skip answers; ``function`` labels with the rubric ``reward.function``; ``gold`` with the
    gold judge.
    """
    settings, context = job.settings, job.context
    labeler, round_index = settings.labeler, len(settings.earlier)
    first_pair_id = context.iteration * PAIRS_PER_ITERATION + pair_count(settings.earlier)
    seed = job.seed(round_index=round_index)
    if labeler == "reward_model":
        return label_shards(job)
    shown: dict[str, float] = {}
    if labeler == "import":
        if settings.preferences is None:
            raise ValueError("labeler 'import' needs a preferences file")
        table = import_preferences(settings.preferences.path) if context.iteration == 0 else PREFERENCES.empty_table()
    elif labeler == "human":
        pairs = candidate_pairs(read_table(settings.candidates.directory, "candidates"))
        table = human_table(pairs, _answers(settings.labels), first_pair_id=first_pair_id)
        # A person's ties are dropped, not stored with margin 0: count them among the pairs shown.
        ties = 1.0 - table.num_rows / max(len(pairs), 1)
        shown = {
            "tie_fraction": ties,
            "decisive_fraction": 1.0 - ties,
            "decisive_pairs": float(table.num_rows),  # a person's answer has no margin: each kept one has a winner
            "ties": float(len(pairs) - table.num_rows),
        }
    elif labeler == "function":
        if settings.rubric is None:
            raise ValueError("labeler 'function' needs a rubric: `reward.function`")
        tokenizer = load_tokenizer(context.base.tokenizer.path)
        rows = read_prompts(context.base.prompts.path)  # a candidate's prompt_id is its prompt's row
        candidates = read_table(settings.candidates.directory, "candidates")
        groups = candidate_groups(candidates, columns=[row.columns for row in rows], pairing=settings.pairing)
        rubric = FunctionLabeler(settings.rubric.load(), settings.rubric.name, render=partial(prompt_text, tokenizer))
        table, shown = paired_table(groups, rubric, settings.pairing, seed=seed, first_pair_id=first_pair_id)
    else:
        if settings.judge is None:
            raise ValueError("labeler 'gold' needs a gold judge")
        groups = candidate_groups(read_table(settings.candidates.directory, "candidates"), pairing=settings.pairing)
        judge = JudgeLabeler(settings.judge.load())
        table, shown = paired_table(groups, judge, settings.pairing, seed=seed, first_pair_id=first_pair_id)
    return {**gather(job, table), **shown}


def gather(job: Job[CollectPreferencesSettings], table: pa.Table) -> dict[str, float]:
    """Write the ``preferences`` table; its pair count, decisive pairs, ties and (the pairs being those compared, as
    consecutive pairs are) share of ties and of decisive pairs. A labeler that compares more pairs than it keeps
    (:func:`paired_table`) or drops ties (``human``) says its own ``ties`` and shares."""
    job.out.write_table("preferences", table, schema=PREFERENCES, rows_per_shard=job.settings.rows_per_shard)
    if job.settings.labeler == "import":  # an imported pair is chosen over rejected: a margin of 0 means none was
        return {"pairs": float(table.num_rows)}  # given, not a tie
    ties = pc.sum(pc.equal(table.column("margin"), 0.0)).as_py() or 0
    share = ties / max(table.num_rows, 1)
    return {
        "pairs": float(table.num_rows),
        "decisive_pairs": float(table.num_rows - ties),
        "ties": float(ties),
        "tie_fraction": share,
        "decisive_fraction": 1.0 - share,
    }


def pair_count(preferences: Sequence[StageResult]) -> int:
    """The preference pairs the ``preferences`` outputs hold, from their manifests (no table is read)."""
    return sum(read_manifest(result.directory, verify=False).rows("preferences") for result in preferences)


def _answers(labels: StageResult | None) -> pa.Table:
    if labels is None:
        raise ValueError("labeler 'human' needs the person's answers (`labels`): run it through the iteration flow")
    return read_table(labels.directory, "human_labels")


def label_shards(job: Job[CollectPreferencesSettings]) -> Iterator[pa.Table]:
    """The ``preferences`` rows of each shard of the candidate pairs, labelled by the reward model (the pretrained
    ``model.reward_model`` where no iteration has trained one yet)."""
    settings, context = job.settings, job.context
    models = job.models(settings.precision)
    pairs = candidate_pairs(read_table(settings.candidates.directory, "candidates"))
    judge = (
        settings.reward_model.directory / "reward_model"
        if settings.reward_model is not None
        else context.base.reward_model.path
    )
    scorer = reward_scorer(
        models.load("reward_model", judge),
        policy_tokenizer_dir=context.base.tokenizer.path,
        reward_tokenizer_dir=context.base.reward_tokenizer,
    )
    labeler = RewardModelLabeler(scorer, autocast=models.autocast)
    first = context.iteration * PAIRS_PER_ITERATION + pair_count(settings.earlier)
    for shard in job.shards:
        first_pair_id = first + shard.start
        yield labelled_table(pairs[shard.start : shard.stop], labeler, first_pair_id=first_pair_id)


collect_preferences = Stage(CollectPreferencesSettings, plan=plan, work=work, gather=gather)
