"""The demo's shipped instruction set is what :func:`demo.demonstrations.demonstrations` writes, and every row is a
prompt of the demo's shape with a completion the hidden rubric scores as a finished sentence."""

from __future__ import annotations

import json

from demo.demonstrations import SHIPPED, demonstrations
from demo.gold import gold_score
from storage.importers import import_sft_examples


def test_the_shipped_set_is_what_the_generator_writes():
    assert [json.loads(line) for line in SHIPPED.read_text().splitlines()] == demonstrations()


def test_each_row_imports_and_the_rubric_likes_it():
    table = import_sft_examples(SHIPPED)
    assert table.num_rows == 48
    for row in demonstrations():
        assert 2 <= len(row["prompt"].split()) <= 4 and row["completion"].startswith(" ")
        assert row["completion"].endswith(" .") and gold_score(row["prompt"], row["completion"].strip()) > 2
