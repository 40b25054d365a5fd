"""A fan-out stage's work in shards: boundaries from the data and ``rows_per_shard`` only, never from the workers.

Each shard draws from its own generator seeded from ``(seed, stage, iteration, shard)``
(:func:`runtime.seeds.shard_seed`), and sampling draws its uniforms on the CPU, so a shard's rows are the same
wherever it runs (:mod:`runtime.fanout`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from runtime.seeds import row_seed, shard_seed


@dataclass(frozen=True)
class Shard:
    """Items ``[start, stop)`` of a stage's work (prompts, or candidate pairs), and the seed of their generator."""

    index: int
    start: int
    stop: int
    seed: int

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with this shard's seed."""
        return torch.Generator().manual_seed(self.seed)

    def row_seeds(self, rows: range) -> list[int]:
        """One seed per output row (``rows``: their numbers in the stage's output), for a generation engine that
        seeds each request on its own (:func:`runtime.seeds.row_seed`)."""
        return [row_seed(self.seed, row) for row in rows]

    def batches(self, size: int) -> Iterator[slice]:
        """Consecutive slices of at most ``size`` items covering the shard, as indices into all items."""
        for start in range(self.start, self.stop, size):
            yield slice(start, min(start + size, self.stop))


def plan_shards(
    items: int, *, rows_per_shard: int, rows_per_item: int, seed: int, stage: str, iteration: int, round_index: int = 0
) -> tuple[Shard, ...]:
    """Split ``items`` items, each giving ``rows_per_item`` rows, into shards of about ``rows_per_shard`` rows.

    A shard holds ``max(1, rows_per_shard // rows_per_item)`` whole items (a prompt's candidates or group
    never straddle two shards); the last holds the rest. ``round_index``: the round of the iteration's candidates
    (:func:`runtime.seeds.shard_seed`).

    Raises:
        ValueError: a count is not positive.
    """
    if rows_per_shard <= 0 or rows_per_item <= 0:
        raise ValueError(f"`rows_per_shard` and rows per item must be positive, got {rows_per_shard}, {rows_per_item}")
    per_shard = max(1, rows_per_shard // rows_per_item)
    return tuple(
        Shard(
            index,
            start,
            min(start + per_shard, items),
            shard_seed(seed, stage, iteration, index, round_index=round_index),
        )
        for index, start in enumerate(range(0, items, per_shard))
    )
