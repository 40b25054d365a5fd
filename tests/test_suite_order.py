"""The suite's own order (tests/conftest.py): the files it starts first exist."""

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_started_first_exists():
    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
