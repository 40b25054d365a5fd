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

With ``asking.select`` random or uncertain the labeler is asked about only ``asking.pairs`` of the compared pairs a
round (:func:`asked_pairs_of`): the held-out share drawn at random, written first and counted in the metric
``held_out_head`` (:data:`tasks.pairing.HELD_OUT_HEAD`), the rest by the previous reward model's margin.
``asked_pairs`` counts them, ``compared_pairs`` the pairs they were chosen from.

A later round of the iteration's candidates (``sizes.decisive_pairs``) numbers its pairs after the earlier rounds'
(``earlier``), so a pair id names one pair across the whole campaign.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from itertools import groupby
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from rlhf_core.config import Pairing, held_out_pairs
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
from tasks.pairing import (
    HELD_OUT_HEAD,
    AskedPairs,
    askable_pairs,
    asked_pairs,
    compared_pairs,
    held_out_head,
    kept_pairs,
)
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


def asked_table(
    compared: list[CandidatePair], asked: AskedPairs, labeler: Labeler, pairing: Pairing, *, first_pair_id: int
) -> tuple[pa.Table, dict[str, float]]:
    """Label only the ``asked`` pairs of ``compared`` and keep them (``all_decisive``: those with a winner), the
    held-out ones first; their count is the metric ``held_out_head``, which the reward model holds out
    (:func:`tasks.pairing.held_out_head`).

    Returns:
        The ``preferences`` table, and the metrics ``compared_pairs``, ``asked_pairs``, ``decisive_fraction``,
        ``ties`` and ``held_out_head``.
    """
    indices = [*asked.held_out, *asked.chosen]
    labels = labeler.label([compared[index] for index in indices])
    kept = [row for row, label in enumerate(labels) if pairing == "consecutive" or label.margin > 0]
    decisive = sum(label.margin > 0 for label in labels)
    table = pair_table(
        [compared[indices[row]] for row in kept], [labels[row] for row in kept], labeler.name, first_pair_id
    )
    return table, {
        "compared_pairs": float(len(compared)),
        "asked_pairs": float(len(indices)),
        "decisive_fraction": decisive / max(len(indices), 1),
        "ties": float(len(indices) - decisive),
        HELD_OUT_HEAD: float(sum(row < len(asked.held_out) for row in kept)),
    }


def asked_pairs_of(job: Job, pairs: Sequence[CandidatePair], *, seed: int) -> AskedPairs:
    """Which of the compared ``pairs`` the labeler is asked about (:func:`tasks.pairing.asked_pairs`): with
    ``asking.select`` uncertain and a previous reward model, by its margins; else at random; never a pair of two
    identical responses (:func:`tasks.pairing.askable_pairs`). ``job`` is a ``collect_preferences`` or ``human_labels`` job (their settings name the same
    ``asking``, ``eval_fraction``, ``reward_model`` and ``precision``)."""
    settings = job.settings
    askable = askable_pairs(pairs)
    budget = min(settings.asking.pairs, len(askable))
    margins = None
    if settings.asking.select == "uncertain" and settings.reward_model is not None:
        judge = _reward_judge(job, settings.reward_model.directory / "reward_model")
        margins = [label.margin for label in judge.label([pairs[index] for index in askable])]
    held_out = held_out_pairs(budget, settings.eval_fraction)
    asked = asked_pairs(len(askable), margins, budget=budget, held_out=held_out, seed=seed)
    return AskedPairs([askable[index] for index in asked.held_out], [askable[index] for index in asked.chosen])


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


def human_table(
    pairs: list[CandidatePair], answers: pa.Table, *, first_pair_id: int, held_out: int | None = None
) -> pa.Table:
    """The preference table of a person's answers (a ``human_labels`` table, one row per pair asked about, in the
    order asked); tie/skip pairs are dropped.

    Args:
        held_out: with ``asking.select``, how many of the first answers are to pairs drawn at random to be held out.

    Raises:
        ValueError: the answers are not to distinct pairs of these candidates, or (without ``held_out``) not one to
            each.
    """
    asked = answers.column(PAIR_ID).to_pylist()
    choices = answers.column(CHOICE).to_pylist()
    expected = sorted(asked) == list(range(len(pairs))) if held_out is None else len(set(asked)) == len(asked)
    if not expected or not set(asked) <= set(range(len(pairs))):
        raise ValueError(f"the human labels hold {answers.num_rows} answers, not one for each of {len(pairs)} pairs")
    if held_out is None:  # one answer per pair: the pairs in their own order
        order = sorted(range(len(asked)), key=asked.__getitem__)
        asked, choices = [asked[row] for row in order], [choices[row] for row in order]
    kept = [row for row in range(len(asked)) if choices[row] != SKIP]
    labeler = HumanLabeler([choices[row] for row in kept])
    return labelled_table([pairs[asked[row]] for row in kept], labeler, first_pair_id=first_pair_id)


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
        answers = _answers(settings.labels)
        held_out = held_out_head(settings.labels)  # the person's answers say it, with `asking.select`
        table = human_table(pairs, answers, first_pair_id=first_pair_id, held_out=held_out)
        # A person's ties are dropped, not stored with margin 0: count them among the pairs shown.
        ties = 1.0 - table.num_rows / max(answers.num_rows, 1)
        shown = {
            "tie_fraction": ties,
            "decisive_fraction": 1.0 - ties,
            "decisive_pairs": float(table.num_rows),  # a person's answer has no margin: each kept one has a winner
            "ties": float(answers.num_rows - table.num_rows),
        }
        if held_out is not None:
            skipped = answers.column(CHOICE).to_pylist()[:held_out].count(SKIP)
            shown |= {"compared_pairs": float(len(pairs)), "asked_pairs": float(answers.num_rows)}
            shown[HELD_OUT_HEAD] = float(held_out - skipped)
    elif labeler == "function":
        if settings.rubric is None:
            raise ValueError("labeler 'function' needs a rubric: `reward.function`")
        tokenizer = load_tokenizer(context.base.tokenizer.path)
        rows = read_prompts(context.base.prompts.path)  # a candidate's prompt_id is its prompt's row
        candidates = read_table(settings.candidates.directory, "candidates")
        groups = candidate_groups(candidates, columns=[row.columns for row in rows], pairing=settings.pairing)
        rubric = FunctionLabeler(settings.rubric.load(), settings.rubric.name, render=partial(prompt_text, tokenizer))
        table, shown = _label_groups(job, groups, rubric, seed=seed, first_pair_id=first_pair_id)
    else:
        if settings.judge is None:
            raise ValueError("labeler 'gold' needs a gold judge")
        groups = candidate_groups(read_table(settings.candidates.directory, "candidates"), pairing=settings.pairing)
        judge = JudgeLabeler(settings.judge.load())
        table, shown = _label_groups(job, groups, judge, seed=seed, first_pair_id=first_pair_id)
    return {**gather(job, table), **shown}


def _label_groups(
    job: Job[CollectPreferencesSettings], groups: list[PromptPairs], labeler: Labeler, *, seed: int, first_pair_id: int
) -> tuple[pa.Table, dict[str, float]]:
    """The compared pairs of ``groups`` labelled and kept by ``pairing``: all of them (:func:`paired_table`), or with
    ``asking.select`` those asked about (:func:`asked_table`)."""
    pairing = job.settings.pairing
    if job.settings.asking.select == "all":
        return paired_table(groups, labeler, pairing, seed=seed, first_pair_id=first_pair_id)
    compared = [pair for group in groups for pair in group.pairs]
    asked = asked_pairs_of(job, compared, seed=seed)
    return asked_table(compared, asked, labeler, pairing, first_pair_id=first_pair_id)


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
    pairs = candidate_pairs(read_table(settings.candidates.directory, "candidates"))
    judge = (
        settings.reward_model.directory / "reward_model"
        if settings.reward_model is not None
        else context.base.reward_model.path
    )
    labeler = _reward_judge(job, judge)
    first = context.iteration * PAIRS_PER_ITERATION + pair_count(settings.earlier)
    for shard in job.shards:
        first_pair_id = first + shard.start
        yield labelled_table(pairs[shard.start : shard.stop], labeler, first_pair_id=first_pair_id)


def _reward_judge(job: Job, reward_model: Path) -> RewardModelLabeler:
    """The reward model in the folder ``reward_model`` as a labeler (its margin: the score gap), in the job's
    ``precision``."""
    context = job.context
    models = job.models(job.settings.precision)
    scorer = reward_scorer(
        models.load("reward_model", reward_model),
        policy_tokenizer_dir=context.base.tokenizer.path,
        reward_tokenizer_dir=context.base.reward_tokenizer,
    )
    return RewardModelLabeler(scorer, autocast=models.autocast)


collect_preferences = Stage(CollectPreferencesSettings, plan=plan, work=work, gather=gather)
