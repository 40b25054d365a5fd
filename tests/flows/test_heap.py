"""The process's long-lived objects are frozen once, after its first iteration (flows.heap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FREEZE_TWICE = """
import gc, weakref
from flows.heap import freeze_long_lived

class Node:
    pass

kept = [Node() for _ in range(1000)]
cycle = Node(); cycle.self = cycle; dead = weakref.ref(cycle); del cycle  # garbage only the collector frees
assert gc.get_freeze_count() == 0
freeze_long_lived()
assert dead() is None, "the garbage was frozen instead of collected"
frozen = gc.get_freeze_count()
assert frozen >= len(kept), frozen
later = [Node() for _ in range(1000)]
freeze_long_lived()
assert gc.get_freeze_count() == frozen, "a second call froze the objects made since"
"""


def test_the_first_freeze_collects_the_garbage_first_and_a_second_freezes_nothing_more():
    subprocess.run([sys.executable, "-c", FREEZE_TWICE], cwd=ROOT, check=True)
