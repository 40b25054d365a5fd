"""Packing: several examples in one row, each attending only to itself, so a batch holds less padding.

Choices:
1. Examples are packed whole (never split) into rows of at most ``length`` tokens, as few cells as a greedy
   balanced partition finds (:func:`pack_rows`), and the rows right-padded to the longest. TRL packs a whole data set
   into rows of ``max_length`` (best-fit decreasing); here one minibatch at a time, so its steps stay the unpacked
   run's.
2. The rows go to the forward with ``position_ids`` that restart at 0 at each example and no attention mask.
   transformers 5.x's masking utilities (``masking_utils.find_packed_sequence_indices``, called by
   ``create_causal_mask`` when the 2D mask is None and there is no cache) read the restarts as boundaries and build a
   block-diagonal causal mask for sdpa and eager attention; flash attention reads the same boundaries from the
   positions. Each example then sees only itself, at its own positions: its logits are those of the example alone, up
   to rounding (another matmul shape). GPT-2 (the demo world's) and Llama (SmolLM2) pass ``position_ids`` to
   ``create_causal_mask`` in transformers 5.25; :func:`keeps_packed_examples_apart` checks any model by its forward.
3. The padding after a row's examples is a sequence of its own (positions from 0), so no example attends to it, and
   it is never learned; it repeats the row's first token (any id would do; the pad id would make transformers warn
   of padding without an attention mask).
4. An example's first token is never a target (the logits just before it are its neighbour's), as the first token
   of an unpacked row is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf_core.models import dropout_disabled


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The indices of ``lengths`` in rows of at most ``capacity`` tokens with the fewest cells (choice 1).

    For each number of rows ``r`` the examples go longest first (ties by index) each into the row that holds the
    fewest tokens so far (the first of those tied): a greedy balanced partition (longest processing time first). Of
    the partitions no wider than ``capacity`` the one of fewest cells (``r`` x its longest row) wins, on a tie the one
    of more, narrower rows. With ``r`` = one row per example it is the unpacked layout, so packing never makes more
    cells, nor a wider row, than padding each example to the longest.

    Naive equivalent::

        def rows_of(r):
            rows = [[] for _ in range(r)]
            for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
                min(rows, key=lambda row: sum(lengths[j] for j in row)).append(i)
            return rows
        width = lambda rows: max(sum(lengths[j] for j in row) for row in rows)
        fits = [rows_of(r) for r in range(len(lengths), 0, -1) if width(rows_of(r)) <= capacity]
        return min(fits, key=lambda rows: len(rows) * width(rows))  # the first of the fewest: more rows

    Raises:
        ValueError: a length beyond ``capacity`` (an example is never split).
    """
    if lengths and max(lengths) > capacity:
        raise ValueError(f"an example of {max(lengths)} tokens does not fit a packed row of {capacity}")
    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    best: list[list[int]] = [[index] for index in longest_first]
    fewest = len(lengths) * max(lengths, default=0)
    for count in range(len(lengths) - 1, 0, -1):
        rows: list[list[int]] = [[] for _ in range(count)]
        tokens = [0] * count
        for index in longest_first:
            row = tokens.index(min(tokens))
            rows[row].append(index)
            tokens[row] += lengths[index]
        if max(tokens) <= capacity and count * max(tokens) < fewest:
            best, fewest = rows, count * max(tokens)
    return best


@dataclass(frozen=True)
class PackedRows:
    """Examples packed several to a row (choice 2), right-padded.

    Shapes:
        input_ids, position_ids, loss_mask: (B', T'), B' no more than the examples.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments: the rows and their positions (no mask: the positions say it)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}


def pack(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: Sequence[int], *, length: int) -> PackedRows:
    """Right-padded rows, ``lengths[b]`` tokens of row ``b`` each, packed into rows of at most ``length`` tokens.

    Naive equivalent of a packed row holding examples ``i, j`` then ``k`` cells of padding::

        input_ids    = ids[i] + ids[j] + [ids[i][0]] * k
        position_ids = [0 .. len(i) - 1] + [0 .. len(j) - 1] + [0 .. k - 1]
        loss_mask    = [False] + mask[i][1:] + [False] + mask[j][1:] + [False] * k

    Shapes:
        input_ids, loss_mask: (B, T); returns rows of (B', T').

    Raises:
        ValueError: an example longer than ``length``.
    """
    rows = pack_rows(lengths, length)
    width = max(sum(lengths[index] for index in row) for row in rows)
    device = input_ids.device
    packed_ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # (B', T')
    position_ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # (B', T')
    packed_mask = torch.zeros((len(rows), width), dtype=torch.bool, device=device)  # (B', T')
    for row, members in enumerate(rows):
        start = 0
        for index in members:
            end = start + lengths[index]
            packed_ids[row, start:end] = input_ids[index, : lengths[index]]
            position_ids[row, start:end] = torch.arange(lengths[index], device=device)
            packed_mask[row, start + 1 : end] = loss_mask[index, 1 : lengths[index]]  # choice 4
            start = end
        packed_ids[row, start:] = packed_ids[row, 0]  # choice 3
        position_ids[row, start:] = torch.arange(width - start, device=device)
    return PackedRows(packed_ids, position_ids, packed_mask)


@torch.no_grad()
def keeps_packed_examples_apart(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward keeps packed examples apart (choice 2), tried on one row of two short examples.

    The second example's logits packed after the first are compared with its logits alone (``error``), and so are
    those of the same row under a mask of ones, which turns packing off: what a model that ignores the positions'
    restarts computes (``leak``). A model that honours packing differs from the example alone by rounding only; one
    that does not differs by ``leak`` itself. Honoured: ``error <= leak / 2``.
    """
    device = next(model.parameters()).device
    vocabulary = model.get_input_embeddings().num_embeddings
    first, second = torch.arange(1, 7) % vocabulary, torch.arange(7, 11) % vocabulary  # (6,), (4,)
    row = torch.cat([first, second]).unsqueeze(0).to(device)  # (1, 10)
    positions = torch.cat([torch.arange(6), torch.arange(4)]).unsqueeze(0).to(device)  # (1, 10)
    with dropout_disabled(model):
        alone = model(input_ids=second.unsqueeze(0).to(device), use_cache=False).logits[0].float()  # (4, V)
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0, 6:].float()  # (4, V)
        leaked = (
            model(input_ids=row, position_ids=positions, attention_mask=torch.ones_like(row), use_cache=False)
            .logits[0, 6:]
            .float()
        )  # (4, V)
    error, leak = (packed - alone).abs().max(), (leaked - alone).abs().max()
    return bool(error <= leak / 2)
