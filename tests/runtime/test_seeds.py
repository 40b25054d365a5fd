"""Every seed derives from its coordinates in one place (runtime.seeds), pinned by value: a changed derivation would
change every sampled token of every campaign."""

from __future__ import annotations

import hashlib

from runtime.seeds import row_seed, shard_seed, stage_seed
from runtime.shards import plan_shards


def _pinned(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def test_a_stage_seed_a_shard_seed_and_a_row_seed_are_one_derivation_of_their_coordinates():
    assert stage_seed(7, "rollout", 3) == _pinned("7/rollout/3")
    assert shard_seed(7, "rollout", 3, 2) == _pinned("7/rollout/3/shard-2") == stage_seed(7, "rollout", 3, "shard-2")
    assert row_seed(11, 5) == _pinned("11/row/5")
    assert len({stage_seed(7, "rollout", i) for i in range(100)}) == 100


def test_shards_hold_whole_items_and_seed_their_rows_by_number():
    shards = plan_shards(5, rows_per_shard=4, rows_per_item=2, seed=7, stage="rollout", iteration=3)
    assert [(shard.start, shard.stop) for shard in shards] == [(0, 2), (2, 4), (4, 5)]
    assert shards[1].seed == shard_seed(7, "rollout", 3, 1)
    assert shards[1].row_seeds(range(4, 6)) == [row_seed(shards[1].seed, 4), row_seed(shards[1].seed, 5)]
