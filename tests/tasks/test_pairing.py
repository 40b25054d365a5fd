"""Which of a prompt's candidates become preference pairs (issue 35): consecutive ones, the best against a worse one
(UltraFeedback's binarised pairs), or every decisive pair; worked out by hand on one-word-rubric scores."""

from __future__ import annotations

import dataclasses
import random

import pyarrow as pa
import pytest

from storage.schemas import CANDIDATES, HUMAN_LABELS
from tasks.collect_preferences import asked_table, candidate_groups, human_table, paired_table
from tasks.labelers import FunctionLabeler, Label
from tasks.pairing import HELD_OUT_HEAD, AskedPairs, askable_pairs, asked_pairs, compared_pairs, kept_pairs


def _label(scores: list[float], compared: list[tuple[int, int]]) -> list[Label]:
    """What a scoring labeler answers: the higher score wins by the gap; a tie keeps the first, margin 0."""
    gaps = [scores[first] - scores[second] for first, second in compared]
    return [Label(0 if gap >= 0 else 1, abs(gap)) for gap in gaps]


def test_issue35_the_compared_pairs_of_each_pairing():
    assert compared_pairs(4, "consecutive") == [(0, 1), (2, 3)]
    assert compared_pairs(4, "best_vs_worse") == compared_pairs(4, "all_decisive")
    assert compared_pairs(4, "all_decisive") == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    with pytest.raises(ValueError, match="even number of candidates, got 3"):
        compared_pairs(3, "consecutive")


def test_issue35_consecutive_keeps_every_pair_ties_included():
    compared = compared_pairs(4, "consecutive")
    labels = _label([0.5, 0.5, 1.0, 0.25], compared)  # (0, 1) ties; 2 beats 3 by 0.75
    assert labels == [Label(0, 0.0), Label(0, 0.75)]
    assert kept_pairs(compared, labels, "consecutive", rng=random.Random(0)) == [0, 1]


def test_issue35_all_decisive_keeps_every_pair_with_a_winner():
    compared = compared_pairs(4, "all_decisive")
    # Scores 0.5, 0.5, 1, 0.25: (0, 1) is the only tie of the six pairs.
    labels = _label([0.5, 0.5, 1.0, 0.25], compared)
    assert [label.margin for label in labels] == [0.0, 0.5, 0.25, 0.5, 0.25, 0.75]
    assert kept_pairs(compared, labels, "all_decisive", rng=random.Random(0)) == [1, 2, 3, 4, 5]


def test_issue35_best_vs_worse_is_the_best_candidate_against_one_it_beats_at_random():
    compared = compared_pairs(4, "best_vs_worse")
    labels = _label([0.5, 0.5, 1.0, 0.25], compared)
    # Candidate 2 (score 1) beats 0 (pair 1), 1 (pair 3) and 3 (pair 5): one of those three, drawn by the rng.
    drawn = {kept_pairs(compared, labels, "best_vs_worse", rng=random.Random(seed))[0] for seed in range(20)}
    assert drawn == {1, 3, 5}
    first = kept_pairs(compared, labels, "best_vs_worse", rng=random.Random(7))
    assert first == kept_pairs(compared, labels, "best_vs_worse", rng=random.Random(7))  # seeded: the same pair
    # Two best candidates tie (0 and 2, score 1): the first is chosen, against the one both beat (3, pair 2).
    tied_best = _label([1.0, 0.5, 1.0, 0.5], compared)
    assert {kept_pairs(compared, tied_best, "best_vs_worse", rng=random.Random(s))[0] for s in range(20)} == {0, 2}
    # All tie: no pair.
    assert kept_pairs(compared, _label([0.5] * 4, compared), "best_vs_worse", rng=random.Random(0)) == []


def _candidates(responses: list[list[str]]) -> pa.Table:
    rows = [
        {"prompt_id": prompt_id, "candidate_index": index, "prompt": f"Name a thing {prompt_id}.", "messages": [],
         "response": response, "prompt_ids": [1], "response_ids": [2 + index]}
        for prompt_id, group in enumerate(responses)
        for index, response in enumerate(group)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=CANDIDATES)


def _one_word(prompt, response: str) -> float:
    return 1.0 / len(response.split())


@pytest.mark.parametrize(
    ("pairing", "pairs", "decisive"),
    [
        # prompt 0 scores 1, 1/3, 1/2, 1/2; prompt 1 scores 1/2 four times.
        # consecutive: (0, 1) decisive, (2, 3) tie; prompt 1: two ties. 1 of 4 compared pairs decisive.
        ("consecutive", 4, 1 / 4),
        # every pair: prompt 0 has 5 decisive of 6 ((2, 3) ties), prompt 1 none of 6: 5 of 12.
        ("all_decisive", 5, 5 / 12),
        ("best_vs_worse", 1, 5 / 12),
    ],
)
def test_issue35_the_preference_table_and_its_share_of_decisive_pairs(pairing, pairs, decisive):
    candidates = _candidates([["Apple.", "I like pears.", "A fig.", "Red kiwi."], ["A b.", "C d.", "E f.", "G h."]])
    groups = candidate_groups(candidates, pairing=pairing)
    table, metrics = paired_table(groups, FunctionLabeler(_one_word, "m:one_word"), pairing, seed=0, first_pair_id=10)
    assert table.num_rows == pairs and metrics["decisive_fraction"] == pytest.approx(decisive)
    assert metrics["ties"] == pytest.approx(metrics["compared_pairs"] * (1 - decisive))  # 3 of 4; 7 of 12
    assert table.column("pair_id").to_pylist() == list(range(10, 10 + pairs))
    rows = table.to_pylist()
    if pairing == "best_vs_worse":
        assert rows[0]["chosen"] == "Apple." and rows[0]["rejected"] in ("I like pears.", "A fig.", "Red kiwi.")
    if pairing == "all_decisive":
        assert all(row["margin"] > 0 for row in rows)
        assert {(row["chosen"], row["rejected"]) for row in rows} == {
            ("Apple.", "I like pears."), ("Apple.", "A fig."), ("Apple.", "Red kiwi."),
            ("A fig.", "I like pears."), ("Red kiwi.", "I like pears."),
        }  # fmt: skip


def test_issue43_asked_pairs_draws_the_held_out_share_at_random_then_the_smallest_margins():
    # random.Random(0) shuffles range(6) to [4, 2, 1, 0, 5, 3]. Held out: the first drawn, pair 4 (margin 0.3, not
    # among the smallest). The rest by margin, the draw's order breaking ties: 1 (0.1) and 3 (0.1) before 0 (0.5),
    # 2 (0.9), 5 (2.0); a budget of 3 takes 1 and 3.
    margins = [0.5, 0.1, 0.9, 0.1, 0.3, 2.0]
    assert asked_pairs(6, margins, budget=3, held_out=1, seed=0) == AskedPairs([4], [1, 3])
    # Without margins (iteration 0: no reward model yet) the whole budget is the draw: 4, then 2 and 1.
    assert asked_pairs(6, None, budget=3, held_out=1, seed=0) == AskedPairs([4], [1, 2])
    # The held-out draw never looks at the margins: any margins give the same held-out pairs.
    for trial in range(20):
        other = [random.Random(trial).random() for _ in margins]
        assert asked_pairs(6, other, budget=3, held_out=1, seed=0).held_out == [4]
    # A budget of every pair asks about every pair; the margins only decide which are left out.
    assert asked_pairs(6, margins, budget=6, held_out=2, seed=0) == AskedPairs([2, 4], [0, 1, 3, 5])
    with pytest.raises(ValueError, match="5 values for 6"):
        asked_pairs(6, margins[:5], budget=3, held_out=1, seed=0)


def test_issue43_the_asked_table_holds_the_held_out_pairs_first_and_counts_them():
    # Prompt 0 scores 1, 1/3, 1/2, 1/2; prompt 1 scores 1/2 four times. Consecutive pairs: (0,1) decisive, (2,3)
    # tie, prompt 1's two ties. Asked: held out pair 3 (a tie, kept with consecutive), chosen 0 and 1.
    candidates = _candidates([["Apple.", "I like pears.", "A fig.", "Red kiwi."], ["A b.", "C d.", "E f.", "G h."]])
    compared = [pair for group in candidate_groups(candidates) for pair in group.pairs]
    rubric = FunctionLabeler(_one_word, "m:one_word")
    table, metrics = asked_table(compared, AskedPairs([3], [0, 1]), rubric, "consecutive", first_pair_id=7)
    assert table.column("chosen").to_pylist() == ["E f.", "Apple.", "A fig."]
    assert metrics == {"compared_pairs": 4.0, "asked_pairs": 3.0, "decisive_fraction": 1 / 3, "ties": 2.0,
                       HELD_OUT_HEAD: 1.0}  # fmt: skip
    # all_decisive keeps only pairs with a winner: the held-out tie is dropped, so no row is held out here.
    table, metrics = asked_table(compared, AskedPairs([3], [0, 1]), rubric, "all_decisive", first_pair_id=7)
    assert table.column("chosen").to_pylist() == ["Apple."] and metrics[HELD_OUT_HEAD] == 0.0


def test_issue43_a_persons_answers_to_asked_pairs_keep_the_order_asked_and_drop_skips():
    candidates = _candidates([["Apple.", "I like pears.", "A fig.", "Red kiwi."], ["A b.", "C d.", "E f.", "G h."]])
    pairs = [pair for group in candidate_groups(candidates) for pair in group.pairs]
    answers = pa.table({"pair_id": [3, 0, 1], "choice": ["B", "A", "tie/skip"]}, schema=HUMAN_LABELS)
    table = human_table(pairs, answers, first_pair_id=0, held_out=1)
    assert table.column("chosen").to_pylist() == ["G h.", "Apple."]
    with pytest.raises(ValueError, match="not one for each of 4 pairs"):
        human_table(pairs, answers, first_pair_id=0)  # without a selection, every pair needs its answer


def test_issue43_a_pair_of_two_identical_responses_is_never_asked_about():
    # Prompt 0's consecutive pairs: ("Apple.", "A fig.") and ("A fig.", "A fig."), alike; prompt 1's: two distinct.
    candidates = _candidates([["Apple.", "A fig.", "A fig.", "A fig."], ["A b.", "C d.", "E f.", "G h."]])
    pairs = [pair for group in candidate_groups(candidates) for pair in group.pairs]
    # _candidates gives candidate i the response id 2 + i: make candidates 2 and 3 of prompt 0 the same tokens.
    pairs[1] = dataclasses.replace(pairs[1], second_ids=pairs[1].first_ids)
    assert askable_pairs(pairs) == [0, 2, 3]
