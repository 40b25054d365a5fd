"""Every seed of the pipeline, derived from coordinates (nanochat-style): the one home of the seed derivation.

A seed is a hash of ``(seed, stage, iteration, *more)`` (:func:`stage_seed`): stable across runs, machines and
Python versions, and independent of what ran before. A stage's generator uses ``(seed, stage, iteration)``; a
fan-out shard's adds ``shard-N`` (:func:`shard_seed`); a row sampled by the generation engine, which seeds each
request on its own, adds ``row`` and the row's number in the output (:func:`row_seed`); an episode's turn sampled by
it, ``turn`` and the turn's number to the episode's seed (:func:`turn_seed`). Every stage's code key covers
this module, so editing a derivation re-runs what it seeded.
"""

from __future__ import annotations

import hashlib


def stage_seed(seed: int, stage: str, iteration: int, *more: object) -> int:
    """A 63-bit seed from the coordinates ``(seed, stage, iteration, *more)``."""
    digest = hashlib.sha256("/".join(map(str, (seed, stage, iteration, *more))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def shard_seed(seed: int, stage: str, iteration: int, shard: int, *, round_index: int = 0) -> int:
    """The seed of a fan-out shard's generator: ``(seed, stage, iteration, shard-N)``; a later round of an iteration's
    candidates (``sizes.decisive_pairs``) adds ``round-R`` before the shard, the first round none."""
    return stage_seed(seed, stage, iteration, *round_coordinates(round_index), f"shard-{shard}")


def round_coordinates(round_index: int) -> tuple[str, ...]:
    """The coordinate a later round of an iteration's candidates adds to its seeds: none for the first round, so an
    iteration of one round draws what it drew before rounds existed."""
    return (f"round-{round_index}",) if round_index else ()


def row_seed(shard_seed: int, row: int) -> int:
    """The seed of one output row (``row``: its number in the stage's output) sampled by the engine, from its shard's
    seed: a row's tokens depend on no other row, nor on how rows are batched or where they run."""
    return stage_seed(shard_seed, "row", row)


def episode_seed(seed: int, iteration: int, prompt_id: int, sample: int) -> int:
    """The seed an episode's environment is reset with (:mod:`runtime.environments`): ``(seed, episode, iteration,
    prompt-P, sample-S)``, ``sample`` being the episode's number among its prompt's samples.

    Neither the stage nor the shard is a coordinate: an episode meets the same environment however the rows are
    sharded, and whichever stage of the iteration plays it (two policies' episodes of one prompt's sample S, given the
    same iteration, compare pairwise). The policy's tokens are seeded apart (:func:`turn_seed`)."""
    return stage_seed(seed, "episode", iteration, f"prompt-{prompt_id}", f"sample-{sample}")


def turn_seed(episode_seed: int, turn: int) -> int:
    """The seed of the engine's request for an episode's model turn ``turn`` (0 for the first), from the episode's
    seed (:func:`episode_seed`): ``(episode_seed, turn, T)``. A turn's tokens depend on the episode, its turn and the
    ids so far only, not on the episodes sampled beside it nor on the shards, as :func:`row_seed`'s rows; the two sides
    of an evaluation play a held-out episode from the same seeds, as they draw from the same generator on ``hf``."""
    return stage_seed(episode_seed, "turn", turn)
