"""Every seed derives from its coordinates in one place (runtime.context.stage_seed), pinned by value: a changed
derivation would change every sampled token of every campaign."""

from __future__ import annotations

import hashlib

from runtime.context import stage_seed
from runtime.fanout import shard_seed


def _pinned(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def test_a_stage_seed_and_a_shard_seed_are_one_derivation_of_their_coordinates():
    assert stage_seed(7, "rollout", 3) == _pinned("7/rollout/3")
    assert shard_seed(7, "rollout", 3, 2) == _pinned("7/rollout/3/shard-2") == stage_seed(7, "rollout", 3, "shard-2")
    assert len({stage_seed(7, "rollout", i) for i in range(100)}) == 100
