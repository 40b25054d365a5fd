"""Every seed derives from its coordinates in one place (runtime.seeds), pinned by value: a changed derivation would
change every sampled token of every campaign."""

from __future__ import annotations

import hashlib

from runtime.seeds import episode_seed, row_seed, shard_seed, stage_seed, turn_seed
from runtime.shards import plan_shards


def _pinned(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def test_a_stage_seed_a_shard_seed_and_a_row_seed_are_one_derivation_of_their_coordinates():
    assert stage_seed(7, "rollout", 3) == _pinned("7/rollout/3")
    assert shard_seed(7, "rollout", 3, 2) == _pinned("7/rollout/3/shard-2") == stage_seed(7, "rollout", 3, "shard-2")
    assert row_seed(11, 5) == _pinned("11/row/5")
    assert len({stage_seed(7, "rollout", i) for i in range(100)}) == 100


def test_issue43_a_later_round_of_candidates_seeds_apart_and_the_first_as_before():
    assert shard_seed(7, "sample_candidates", 3, 2, round_index=0) == shard_seed(7, "sample_candidates", 3, 2)
    assert shard_seed(7, "sample_candidates", 3, 2, round_index=1) == _pinned("7/sample_candidates/3/round-1/shard-2")
    shards = plan_shards(4, rows_per_shard=4, rows_per_item=2, seed=7, stage="sample_candidates", iteration=3)
    later = plan_shards(
        4, rows_per_shard=4, rows_per_item=2, seed=7, stage="sample_candidates", iteration=3, round_index=2
    )
    assert [shard.seed for shard in later] == [
        _pinned(f"7/sample_candidates/3/round-2/shard-{index}") for index in range(2)
    ] and not {shard.seed for shard in shards} & {shard.seed for shard in later}


def test_an_episodes_seed_is_a_derivation_of_the_campaigns_seed_iteration_prompt_and_sample():
    assert episode_seed(7, 3, 12, 1) == _pinned("7/episode/3/prompt-12/sample-1")
    assert len({episode_seed(7, 3, prompt, sample) for prompt in range(10) for sample in range(10)}) == 100
    assert episode_seed(7, 3, 12, 1) not in {episode_seed(8, 3, 12, 1), episode_seed(7, 4, 12, 1)}


def test_an_episodes_turn_on_the_engine_is_seeded_from_the_episodes_seed_and_the_turn():
    episode = episode_seed(7, 3, 12, 1)
    assert turn_seed(episode, 0) == _pinned(f"{episode}/turn/0") == 8102357603138485788
    assert turn_seed(episode, 2) == _pinned(f"{episode}/turn/2")
    turns = {turn_seed(episode_seed(7, 3, prompt, 0), turn) for prompt in range(10) for turn in range(5)}
    assert len(turns) == 50 and episode not in turns  # apart from every other turn, and from the environment's seed


def test_shards_hold_whole_items_and_seed_their_rows_by_number():
    shards = plan_shards(5, rows_per_shard=4, rows_per_item=2, seed=7, stage="rollout", iteration=3)
    assert [(shard.start, shard.stop) for shard in shards] == [(0, 2), (2, 4), (4, 5)]
    assert shards[1].seed == shard_seed(7, "rollout", 3, 1)
    assert shards[1].row_seeds(range(4, 6)) == [row_seed(shards[1].seed, 4), row_seed(shards[1].seed, 5)]
