"""A process's long-lived objects are frozen once, as its second iteration starts (flows.heap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

THREE_ITERATIONS = """
import gc, weakref
from flows.heap import iteration_starting

class Node:
    pass

kept = [Node() for _ in range(1000)]
iteration_starting()
assert gc.get_freeze_count() == 0, "a process's first iteration froze objects"
cycle = Node(); cycle.self = cycle; dead = weakref.ref(cycle); del cycle  # garbage only the collector frees
iteration_starting()
assert dead() is None, "the garbage was frozen instead of collected"
frozen = gc.get_freeze_count()
assert frozen >= len(kept), frozen
later = [Node() for _ in range(1000)]
iteration_starting()
assert gc.get_freeze_count() == frozen, "a third iteration froze the objects made since"
"""


def test_the_second_iteration_collects_then_freezes_and_no_other_does():
    subprocess.run([sys.executable, "-c", THREE_ITERATIONS], cwd=ROOT, check=True)
